"""A datatrove pipeline whose generations and output go through a running `inferproxy serve`.

It starts nothing itself. With the built-in simulator standing in for vLLM::

    inferproxy fake-upstream --port 8000 &
    inferproxy serve --upstream http://127.0.0.1:8000 --port 8080 \\
        --output inferproxy-data/output --output-filename '${rank}_chunk_${chunk_index}.jsonl.gz' &
    python examples/datatrove_pipeline.py --proxy http://127.0.0.1:8080 --input input --output inferproxy-data/output

`--input` is a folder of JSON lines files (`{"id": ..., "text": ...}` per line;
`--make-input N` writes N such documents there first). Kill it anywhere and
run it again: finished tasks are skipped, unfinished ones resume where the
proxy says, and every answer the proxy has is not paid for again. The
output is the proxy's: `--output` must be the folder it publishes to, and
the proxy's `--output-filename` is the writer's name with the `.gz` that
JsonlWriter's default `compression="gzip"` adds. Each task's runner counts
the documents of its reader's files as it goes (local JSON lines files read
straight by JsonlReader: exact and cheap) and declares them, so the proxy's
page and `inferproxy status` show progress and ETA from the start; it shows
each rank finished at its end (and the job, once all 4 tasks are).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.inference.run_inference import InferenceConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

from app.integrations.datatrove import ProxyInferenceRunner  # was: InferenceRunner


async def rollout(document: Any, generate: Any) -> str:
    """One sample of an answer to the document's text."""
    result = await generate({"messages": [{"role": "user", "content": document.text}], "max_tokens": 32})
    return str(result.text)


def run(
    proxy_url: str = "http://127.0.0.1:8080",
    input_dir: str = "input",
    output_dir: str = "inferproxy-data/output",
    logs: str = "inferproxy-data/logs",
    *,
    model: str = "fake-model",
    concurrency: int = 500,
) -> None:
    LocalPipelineExecutor(pipeline=[
        JsonlReader(input_dir),
        ProxyInferenceRunner(
            rollout_fn=rollout,                                  # async (document, generate)
            config=InferenceConfig(server_type="endpoint",
                                   endpoint_url=proxy_url,       # the proxy's root
                                   model_name_or_path=model, rollouts_per_document=2,
                                   max_concurrent_generations=concurrency),
            output_writer=JsonlWriter(output_dir, output_filename="${rank}_chunk_${chunk_index}.jsonl"),
        ),
    ], tasks=4, workers=4, logging_dir=logs).run()  # fmt: skip


def make_input(input_dir: str, documents: int, files: int = 4) -> None:
    """`documents` questions in `files` JSON lines files: one input file per task."""
    folder = Path(input_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for part in range(files):
        lines = [
            json.dumps({"id": f"doc-{i}", "text": f"Question {i}: why do caches help batch inference?"})
            for i in range(part, documents, files)
        ]
        (folder / f"part_{part}.jsonl").write_text("".join(line + "\n" for line in lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--proxy", default="http://127.0.0.1:8080", help="the proxy's root URL")
    parser.add_argument("--input", default="input", help="folder of JSON lines documents")
    parser.add_argument("--output", default="inferproxy-data/output", help="the proxy's --output folder")
    parser.add_argument("--logs", default="inferproxy-data/logs", help="datatrove's logging_dir")
    parser.add_argument("--model", default="fake-model", help="the model name sent upstream")
    parser.add_argument("--concurrency", type=int, default=500, help="generations in flight per task")
    parser.add_argument("--make-input", type=int, default=0, metavar="N", help="first write N documents to --input")
    args = parser.parse_args()
    if args.make_input:
        make_input(args.input, args.make_input)
    run(args.proxy, args.input, args.output, args.logs, model=args.model, concurrency=args.concurrency)


if __name__ == "__main__":
    main()
