"""The datatrove pipeline of examples/datatrove_pipeline.py on Slurm, one `inferproxy serve` per node.

Run it where `sbatch` works (a login node), from the folder that holds the venv with inferproxy
and datatrove, with paths every node sees (a shared filesystem)::

    python examples/datatrove_slurm.py --partition gpu --upstream http://127.0.0.1:8000 \\
        --input /shared/input --output /shared/output --checkpoints /shared/checkpoints \\
        --logs /shared/logs

It submits the job array and returns (`squeue` shows it; `inferproxy status http://127.0.0.1:8080`
run on a node shows the proxy there: it listens on the node's loopback only, on `--port`). Each
Slurm job holds one node (`--exclusive`) and runs one task: its job script starts that node's proxy
(`examples/slurm_node_proxy.sh`, as datatrove's `env_command`), pointed at the node's vLLM or SGLang
server (`--upstream`), and the task sends its generations and documents to `http://127.0.0.1:PORT`.
A task cancelled, preempted or out of time: run the same command again. datatrove skips the finished
tasks, and the rerun one resumes after its last published chunk, its cached generations replayed
from the shared checkpoints dir; only what was in flight when it stopped is generated again, and the
output holds every document once.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from datatrove.executor.slurm import SlurmPipelineExecutor
from datatrove.pipeline.inference.run_inference import InferenceConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove_pipeline import make_input, rollout  # this folder is on the tasks' PYTHONPATH too

from app.integrations.datatrove import ProxyInferenceRunner

HERE = Path(__file__).resolve().parent
#: the proxy's name for a published chunk: JsonlWriter's template plus the `.gz` its gzip adds
OUTPUT_FILENAME = "${rank}_chunk_${chunk_index}.jsonl.gz"


def job_script_command(args: argparse.Namespace) -> str:
    """What each job script runs before its task: the venv, then this node's proxy, up and answering."""
    venv, port = args.venv, args.port
    serve = [
        f"--upstream={args.upstream}",
        f"--records-per-chunk={args.records_per_chunk}",
        f"--checkpoints-dir={args.checkpoints}",
        f"--output={args.output}",
        f"--output-filename={OUTPUT_FILENAME}",
    ]
    return (
        f"source {shlex.quote(venv)}/bin/activate\n"
        f"export PYTHONPATH={shlex.quote(str(HERE))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"source {shlex.quote(str(HERE / 'slurm_node_proxy.sh'))} {port} {shlex.join(serve)}"
    )


def submit(args: argparse.Namespace) -> None:
    SlurmPipelineExecutor(
        pipeline=[
            JsonlReader(args.input),
            ProxyInferenceRunner(
                rollout_fn=rollout,
                config=InferenceConfig(
                    server_type="endpoint",
                    endpoint_url=f"http://127.0.0.1:{args.port}",  # this node's proxy
                    model_name_or_path=args.model,
                    rollouts_per_document=2,
                    max_concurrent_generations=args.concurrency,
                ),
                output_writer=JsonlWriter(args.output, output_filename="${rank}_chunk_${chunk_index}.jsonl"),
            ),
        ],
        tasks=args.tasks,
        time=args.time,
        partition=args.partition,
        qos=args.qos,
        cpus_per_task=1,
        mem_per_cpu_gb=1,
        job_name="inferproxy-datatrove",
        env_command=job_script_command(args),
        sbatch_args={"exclusive": ""},  # one job per node, so one proxy per node
        logging_dir=args.logs,
    ).run()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--partition", required=True, help="the Slurm partition the tasks run on")
    parser.add_argument("--upstream", default="http://127.0.0.1:8000", help="each node's vLLM or SGLang server")
    parser.add_argument("--input", required=True, help="folder of JSON lines documents")
    parser.add_argument("--output", required=True, help="the proxies' shared --output (folder or s3://...)")
    parser.add_argument("--checkpoints", required=True, help="the proxies' shared --checkpoints-dir")
    parser.add_argument("--logs", required=True, help="datatrove's logging_dir (shared)")
    parser.add_argument("--port", type=int, default=8080, help="the port of each node's proxy")
    parser.add_argument("--records-per-chunk", type=int, default=6000, help="documents per published chunk")
    parser.add_argument("--tasks", type=int, default=4, help="datatrove tasks (ranks)")
    parser.add_argument("--time", default="24:00:00", help="each job's Slurm time limit")
    parser.add_argument("--qos", default="", help="the Slurm QOS, if your cluster wants one")
    parser.add_argument("--venv", default=sys.prefix, help="the venv each job activates")
    parser.add_argument("--model", default="fake-model", help="the model name sent upstream")
    parser.add_argument("--concurrency", type=int, default=64, help="generations in flight per task")
    parser.add_argument("--make-input", type=int, default=0, metavar="N", help="first write N documents to --input")
    args = parser.parse_args()
    if args.make_input:
        make_input(args.input, args.make_input)
    submit(args)


if __name__ == "__main__":
    main()
