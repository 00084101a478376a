"""`inferproxy run-batch -i INPUT -o OUTPUT --upstream URL`: one OpenAI batch file through the Batch API's
engine in this process (no HTTP server), for a script or a Slurm job, in vLLM's `run-batch` file format.

INPUT holds one `{"custom_id", "method", "url", "body"}` per line, all with one `url` (the endpoint);
OUTPUT gets one line per input line, in input order, successes and errors alike, as OpenAI's batch output
(`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`). Either may be a local
path or an fsspec URL (`s3://bucket/key`). OUTPUT is written whole or not at all: a temporary file,
fsynced and renamed over it; for an object store, uploaded once complete.

The state (a copy of the input, the batch, its answers) is kept under `--checkpoints-dir`, else beside a
local OUTPUT in `OUTPUT.inferproxy/`:

    <state>/run-batch.json    which input (its bytes and xxh128) and which batch, replaced atomically
    <state>/run-batch.lock    flock'ed while a run-batch works on the state
    <state>/files/            the input's copy (and the engine's output and error files)
    <state>/batches/          the batch (`app.store.batches`) and the answers' cache

The ids are reserved in `run-batch.json` before anything is created under them, so that a kill at any
point leaves nothing the next run does not know of: run again with the same arguments, it finds its batch
and carries on, paying only for what was in flight. A batch that ended with lines failed by the upstream
(after every retry) is run again whole by the next run: its answered lines are hits in the answers' cache,
so only the failed ones are sent.

The package, one concern a module, lowest first: `errors` (why it stops, its exit codes), `state` (the state
folder: its lock, `run-batch.json`, the input's identity), `input` (opening the input, reading it once, the
refusals), `output` (OUTPUT written whole), `report` (the progress bar, the line a failure ends with) and
`runner` (the command's flow: the checks before anything is sent, the batch driven to its end).
"""

from __future__ import annotations

from app.tools.run_batch.errors import BAD_INPUT, OK, UNANSWERED, RunBatchError, Stopped
from app.tools.run_batch.report import Progress
from app.tools.run_batch.runner import UPSTREAM_WAIT_S, Options, Runner, main
from app.tools.run_batch.state import State, state_dir

__all__ = [
    "BAD_INPUT",
    "OK",
    "UNANSWERED",
    "UPSTREAM_WAIT_S",
    "Options",
    "Progress",
    "RunBatchError",
    "Runner",
    "State",
    "Stopped",
    "main",
    "state_dir",
]
