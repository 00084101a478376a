"""datatrove pipelines through inferproxy (`pip install 'inferproxy[datatrove]'`).

`ProxyInferenceRunner` is datatrove's `InferenceRunner` (same constructor,
rollout functions `async (document, generate)`, output writer argument and
stats) pointed at a running `inferproxy serve`::

    from app.integrations.datatrove import ProxyInferenceRunner   # was: InferenceRunner

    ProxyInferenceRunner(
        rollout_fn=rollout,
        config=InferenceConfig(server_type="endpoint", endpoint_url="http://127.0.0.1:8080",
                               model_name_or_path="my-model", rollouts_per_document=2),
        output_writer=JsonlWriter(output_dir, output_filename="${rank}_chunk_${chunk_index}.jsonl"),
    )

- every generation goes to the proxy with `X-Doc-Id`, `X-Rollout-Idx`,
  `X-Chunk-Index`, `X-Rank` (and `Authorization` when `config.api_key` is
  set) over kept-alive connections, so the proxy caches it: the runner keeps
  no request cache of its own and writes no sqlite file. Each also carries
  datatrove's own key for it (`X-Datatrove-Payload-Hash`: the rollout's
  payload hashed before `model` and `default_generation_params` are merged
  in), which the proxy keys and stores the answer by as datatrove's runner
  does: a job switched from datatrove's runner to this one on the same
  checkpoints dir (the proxy's `--checkpoints-dir`), or back, replays what
  the other cached;
- checkpoints are the proxy's (`ProxyCheckpointManager`: `GET /resume`,
  `POST /documents`, `POST /chunks/{i}/complete`), and so is `records_per_chunk`;
- exactly one party writes the output: the proxy publishes each complete
  chunk to its `--output` under its `--output-filename`. The runner writes
  nothing, and stops at start unless its `output_writer` names that folder
  and that template;
- 429/502/503/504, connection errors and timeouts are retried with
  exponential backoff (`Retry-After` honoured), then the task fails with
  datatrove's `ServerError`, so the executor runs it again; 400 (fresh or
  cached) is datatrove's `InferenceError` with "BadRequestError" in it, so
  `skip_bad_requests=True` works as before; 500 is a `ServerError`, as with
  datatrove's own servers;
- each rank's total goes to the proxy (`X-Total-Documents`, for its progress
  and ETA) once it is known exactly: `total_documents=`, a list's length, or
  the documents of a `JsonlReader`'s local files, counted while the rank runs
  (`totals`); else at the rank's end;
- a document the proxy refuses is logged as an error and counted in
  `failed_documents`; the task then fails at its end with the last chunk left
  open, so that a rerun sends the document again once the cause is fixed.

`with_inferproxy_checkpointing(runner)` keeps datatrove's own runner
in-process and gives it inferproxy's `RequestCache` and `CheckpointManager`.
"""

from __future__ import annotations

from app.integrations.datatrove.checkpoints import (
    DocumentRefused,
    ProxyCheckpointManager,
    check_output_writer,
)
from app.integrations.datatrove.runner import ProxyInferenceRunner, with_inferproxy_checkpointing

__all__ = [
    "DocumentRefused",
    "ProxyCheckpointManager",
    "ProxyInferenceRunner",
    "check_output_writer",
    "with_inferproxy_checkpointing",
]
