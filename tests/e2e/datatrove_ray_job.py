"""The example's pipeline on datatrove's RayPipelineExecutor, on a local Ray cluster started here.

    python datatrove_ray_job.py PROXY_URL INPUT OUTPUT LOGS

The cluster is small and on loopback only (no dashboard); it stops with this
process. On a real cluster, `ray.init(address="auto")` instead, and each task's
`endpoint_url` is its own node's proxy.
"""

from __future__ import annotations

import sys

import ray
from datatrove.executor.ray import RayPipelineExecutor
from datatrove.pipeline.inference.run_inference import InferenceConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove_pipeline import rollout  # examples/ is on PYTHONPATH, for Ray's workers too

from app.integrations.datatrove import ProxyInferenceRunner


def main(proxy_url: str, input_dir: str, output_dir: str, logs: str) -> None:
    ray.init(
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=80 * 1024 * 1024,
        log_to_driver=False,
    )
    try:
        RayPipelineExecutor(
            pipeline=[
                JsonlReader(input_dir),
                ProxyInferenceRunner(
                    rollout_fn=rollout,
                    config=InferenceConfig(
                        server_type="endpoint",
                        endpoint_url=proxy_url,
                        model_name_or_path="fake-model",
                        rollouts_per_document=2,
                        max_concurrent_generations=8,
                    ),
                    output_writer=JsonlWriter(output_dir, output_filename="${rank}_chunk_${chunk_index}.jsonl"),
                ),
            ],
            tasks=4,
            workers=2,
            cpus_per_task=1,
            mem_per_cpu_gb=0.25,
            logging_dir=logs,
        ).run()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
