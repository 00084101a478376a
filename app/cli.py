"""The `inferproxy` command.

    inferproxy serve [--config FILE] [--upstream URL]... [--port 8080] ...   the caching proxy
    inferproxy run-batch -i INPUT -o OUTPUT [--upstream URL]... ...          one batch file, resumable
    inferproxy fake-upstream [--port 8000] [--latency-ms 0]                  a vLLM-shaped simulator
    inferproxy demo [--documents N] [--rollouts R] [--kills K] ...           the quickstart
    inferproxy inspect CHECKPOINTS_DIR [--rank N] [--json]                   a checkpoints dir, read-only
    inferproxy status [URL] [--once] [--json] [--api-key KEY]                a running proxy's numbers

Every `serve` flag is a field of `app.service.settings.Settings`, also read from
`INFERPROXY_<NAME>` and from the TOML file given with `--config`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app import __version__
from app.ops import logs
from app.service.settings import (
    CONFIG_ENV,
    Settings,
    config_file_keys,
    config_file_path,
    unknown_setting,
    unknown_variables,
)
from app.tools import demo, status


# argparse prefixes a type's ArgumentTypeError with the flag ("argument --port: must be ...");
# a ValueError would instead become "invalid _positive value", naming the function.
def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _port(text: str) -> int:
    value = _integer(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text!r}")
    return value


def _rank(text: str) -> int:
    from app.service.keys import MAX_RANK

    value = _integer(text, 0)
    if value > MAX_RANK:
        raise argparse.ArgumentTypeError(f"must be a rank from 0 to {MAX_RANK}, got {text!r}")
    return value


#: The longest fake generation time: an hour (an infinite one left a process that no signal stopped).
MAX_LATENCY_MS = 3_600_000.0


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_LATENCY_MS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds from 0 to {MAX_LATENCY_MS:.0f}, got {text!r}"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _wait_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one: `(default: None)` tells a reader nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def setting_default(name: str) -> str:
    """A setting's default as it is written on the command line ("not set" for None)."""
    info = Settings.model_fields[name]
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "not set"
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value)


def _setting_help(name: str) -> str:
    description = Settings.model_fields[name].description or name
    if "default:" not in description:
        description = f"{description} (default: {setting_default(name)})"
    return description.replace("%", "%%")  # argparse %-formats help texts


def _settings_arguments(
    parser: argparse.ArgumentParser, *, skip: Collection[str] = (), helps: dict[str, str] | None = None
) -> None:
    """One flag per Settings field (but those in `skip`; `helps`: other help texts); values are validated by
    Settings, which names what is wrong."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML file with settings, keys as the setting names (default: ${CONFIG_ENV} if set)",
    )
    # The flags' own defaults stay None, so Settings can tell a flag given from one left to the
    # environment, the file or the default; the help shows the setting's real default instead.
    for name, info in Settings.model_fields.items():
        if name in skip:
            continue
        annotation = info.annotation
        origin = typing.get_origin(annotation)
        kwargs: dict[str, Any] = {"default": None, "help": (helps or {}).get(name) or _setting_help(name), "dest": name}
        if origin is list or (
            typing.get_args(annotation) and typing.get_origin(typing.get_args(annotation)[0]) is list
        ):
            kwargs["action"] = "append"
            kwargs["metavar"] = "VALUE"
            kwargs["help"] = f"{_setting_help(name)}; repeat the flag for several"
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
            if name == "log_level":  # Settings lower-cases it; the flag takes `DEBUG` as well
                kwargs["type"] = str.lower
        parser.add_argument(flag_name(name), **kwargs)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = demo.DemoOptions()
    parser.add_argument("--documents", type=_positive, default=defaults.documents, help="documents in the job")
    parser.add_argument("--rollouts", type=_positive, default=defaults.rollouts, help="generations per document")
    parser.add_argument(
        "--records-per-chunk", type=_positive, default=defaults.records_per_chunk, help="documents per published chunk"
    )
    parser.add_argument("--concurrency", type=_positive, default=defaults.concurrency, help="documents in flight")
    parser.add_argument("--model", default=defaults.model, help="the model name sent upstream")


#: Settings of serve's that run-batch has no use for: it listens on no port, publishes no chunks, keeps no ranks.
RUN_BATCH_SKIPS = frozenset(
    {
        "host",
        "port",
        "output",
        "output_filename",
        "records_per_chunk",
        "api_key",
        "max_body_bytes",
        "max_file_bytes",
        "head_timeout_s",
        "body_timeout_s",
        "max_connections",
        "max_queued_requests",
        "rank_idle_s",
        "max_waiting_chunks",
        "backlog_wait_s",
        "publish_retry_max_s",
        "max_open_ranks",
        "max_tracked_ranks",
        "http",
        "log_hits_every",
        "metrics",
    }
)
RUN_BATCH_STATE_HELP = (
    "a local folder for the run's state (the input's copy, the batch, its answers), the same on every rerun "
    "(default: OUTPUT.inferproxy beside a local OUTPUT; required for an object-store OUTPUT)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferproxy", description="Caching and checkpointing for batch inference.")
    parser.add_argument("--version", action="version", version=f"inferproxy {__version__}")
    # `demo-job` is what `demo` runs, not for users: a parser of its own (`build_job_parser`).
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{serve,run-batch,fake-upstream,demo,inspect,status}"
    )
    shows_defaults = _HelpFormatter

    serve_parser = commands.add_parser(
        "serve", help="run the caching proxy in front of vLLM/SGLang", formatter_class=shows_defaults
    )
    _settings_arguments(serve_parser)

    batch_parser = commands.add_parser(
        "run-batch",
        help="run one OpenAI batch file through the upstream, resumable after any kill (vLLM's run-batch format)",
        description="Send every line of an OpenAI batch file (INPUT) to the upstream, with serve's cache, retries "
        "and replicas, and write one answer per line to OUTPUT, whole. Killed anywhere and run again with the "
        "same arguments, it carries on and pays only for what was in flight. Exit 0: every line answered (2xx or "
        "4xx); 1: lines the upstream never answered (rerun to retry those) or OUTPUT not written; 2: a bad input "
        "or setting, nothing sent; 128+N: stopped by signal N, rerun to carry on.",
        formatter_class=shows_defaults,
    )
    batch_parser.add_argument(
        "-i", "--input-file", required=True, metavar="INPUT", help="the batch file: a local path or an fsspec URL"
    )
    batch_parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        metavar="OUTPUT",
        help="where the answers go: a local path or an fsspec URL",
    )
    batch_parser.add_argument(
        "--upstream-wait-s",
        type=_wait_seconds,
        help="how long to wait for an upstream to answer GET /v1/models before sending (one being started); "
        "none by then: exit 2, nothing sent (0: fail at once; default: 60)",
    )
    _settings_arguments(batch_parser, skip=RUN_BATCH_SKIPS, helps={"checkpoints_dir": RUN_BATCH_STATE_HELP})

    fake = commands.add_parser(
        "fake-upstream", help="run a vLLM-shaped OpenAI-compatible simulator", formatter_class=shows_defaults
    )
    fake.add_argument("--host", default="127.0.0.1", help="address to listen on")
    fake.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free one)")
    fake.add_argument("--latency-ms", type=_milliseconds, default=0.0, help="delay before every answer")
    fake.add_argument("--model", default="fake-model", help="the one model name served")

    defaults = demo.DemoOptions()
    demo_parser = commands.add_parser(
        "demo", help="kill a batch job and its proxy, restart them, check the output", formatter_class=shows_defaults
    )
    _demo_arguments(demo_parser)
    demo_parser.add_argument("--workdir", type=Path, default=defaults.workdir, help="where checkpoints and output go")
    demo_parser.add_argument(
        "--kills", type=_non_negative, default=defaults.kills, help="times the job is killed with SIGKILL and restarted"
    )
    demo_parser.add_argument(
        "--kill-proxy",
        choices=["never", "alternate", "always"],
        default=defaults.kill_proxy,
        help="whether the proxy is killed with the job",
    )
    demo_parser.add_argument(
        "--latency-ms", type=_milliseconds, default=defaults.latency_ms, help="fake generation time"
    )
    demo_parser.add_argument("--upstream", default=None, help="a real vLLM/SGLang server instead of the fake one")
    demo_parser.add_argument("--seed", type=_int, default=None, help="fixes the kill moments (default: random)")

    inspect_parser = commands.add_parser(
        "inspect",
        help="report what a checkpoints dir holds per rank (and what /resume will answer after a restart), "
        "and its batches and files",
        description="Read a checkpoints dir (a running proxy's or a dead one's) without writing anything.",
    )
    inspect_parser.add_argument("checkpoints_dir", metavar="CHECKPOINTS_DIR", help="the proxy's --checkpoints-dir")
    inspect_parser.add_argument("--rank", type=_rank, action="append", metavar="N", help="only this rank; repeatable")
    inspect_parser.add_argument("--json", action="store_true", help="JSON for machines (docs/contract.md)")
    inspect_parser.add_argument(
        "--records-per-chunk",
        type=_positive,
        metavar="N",
        help="the value the proxy will be restarted with: needed only where checkpoint_meta.json does not record it",
    )
    inspect_parser.add_argument(
        "--output",
        metavar="URL",
        help="the proxy's --output: looked at for ranks without checkpoints, as a restarted proxy does",
    )
    inspect_parser.add_argument(
        "--output-filename",
        metavar="TEMPLATE",
        help="the proxy's --output-filename, with --output (default: the proxy's default)",
    )

    status_parser = commands.add_parser(
        "status", help="a running proxy's numbers in the terminal, every 2 s", formatter_class=shows_defaults
    )
    status_parser.add_argument("url", nargs="?", default=status.DEFAULT_URL, help="the proxy's URL")
    status_parser.add_argument(
        "--once", action="store_true", help="print one snapshot and exit (as when stdout is not a terminal)"
    )
    status_parser.add_argument("--json", action="store_true", help="print /stats' JSON as it comes, once")
    status_parser.add_argument(
        "--api-key", default=None, help="the key the proxy was started with (default: $INFERPROXY_API_KEY)"
    )
    status_parser.add_argument(
        "--timeout",
        type=_seconds,
        default=status.TIMEOUT_S,
        metavar="SECONDS",
        help="the most one fetch of /stats may take (connecting, the answer and its body)",
    )
    status_parser.add_argument(
        "--sort",
        choices=list(status.SORTS),
        default="rank",
        help="order of the ranks: by number, least done first, longest ETA first, slowest first",
    )
    return parser


def build_job_parser() -> argparse.ArgumentParser:
    """`inferproxy demo-job`: what `demo` runs (one run of its job), left out of `inferproxy`'s commands."""
    job_parser = argparse.ArgumentParser(
        prog="inferproxy demo-job", description="the job `demo` runs (one run of it)", formatter_class=_HelpFormatter
    )
    _demo_arguments(job_parser)
    job_parser.add_argument("--proxy", required=True, help="the proxy's URL")
    job_parser.add_argument(
        "--pause-at", type=_positive, default=None, help="documents done at which the job stops to be killed"
    )
    return job_parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; a flag the command does not know is refused with the command's own usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo-job"]:
        return build_job_parser().parse_args(argv[1:], argparse.Namespace(command="demo-job"))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


GC_YOUNG_THRESHOLD = 20_000


def serve(args: argparse.Namespace) -> int:
    from app.ops.memory import limit_malloc_arenas

    # First of all: an arena once made is kept, and checking an s3:// output (below) starts fsspec's
    # and the resolver's threads, each with an arena of its own (3 more, measured) if not capped yet.
    limit_malloc_arenas()
    import uvloop

    from app.checkpoints.output import check_output
    from app.http.server import CannotListen
    from app.service.app import create_server
    from app.store.durable import UnsafeFileError

    flags = {name: getattr(args, name) for name in Settings.model_fields}
    config_file = config_file_path(args.config)
    warn_of_unknown_variables("serve")  # first: a misspelt one may be why what follows fails
    try:
        settings = Settings.load(args.config, **flags)
        # Before the lifespan takes its lock: a start that fails here has created nothing.
        check_checkpoints_dir(settings, setting_source("checkpoints_dir", config_file, flags))
        check_output(settings.output, name=setting_source("output", config_file, flags))
        check_output_apart(settings, setting_source("output", config_file, flags))
        check_port(settings.host, settings.port)
    except ValidationError as exc:
        print(f"inferproxy serve: invalid settings:\n{describe_errors(exc, config_file, flags)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, UnsafeFileError) as exc:
        print(f"inferproxy serve: {exc}", file=sys.stderr)
        return 2
    except CannotListen as exc:
        print(f"inferproxy serve: {exc}", file=sys.stderr)
        return 1
    logs.configure(settings.log_level, settings.log_format)
    raise_open_files_limit()
    server = create_server(settings)
    # What is loaded by now lives as long as the process: keep it out of the
    # garbage collector's generations, which then only scan request garbage.
    gc.freeze()
    # Most of a request's objects are freed by reference counting; a young generation scanned
    # every 700 allocations scans them while they are still alive. Scanned less often, far fewer
    # are still there to scan (bench/README.md: CPU per miss); true cycles wait a little longer.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    try:
        uvloop.run(server.serve(install_signal_handlers=True))
    except CannotListen as exc:  # the port is taken, the address is not ours
        print(f"inferproxy serve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the checkpoints or output dir cannot be created, read or written
        print(f"inferproxy serve: could not start: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("app.cli").info("stopped: every cache flushed, every rank released")
    return 0


def check_port(host: str, port: int) -> None:
    """Bind every address the server will listen on, and let go: a port in use (or an address that is not
    this machine's) is refused before the lifespan creates anything, under either HTTP server."""
    import socket

    from app.http.server import CannotListen

    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise CannotListen(
            f"cannot listen on {host}:{port}: {exc}: give an address of this machine as --host"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers' own listen does
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise CannotListen(
                    f"cannot listen on {host}:{port}: {exc.strerror}: stop what listens there, or choose another "
                    f"--port (or --host)"
                ) from None


def raise_open_files_limit() -> None:
    """Each open rank holds ~7 files (`max_open_ranks`): take the soft limit on open files up to the hard one."""
    import resource

    logger = logging.getLogger("app.cli")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS refuses more than OPEN_MAX
            logger.warning("open files limit stays at %d (hard limit %d): %s", soft, hard, exc)
            return
        logger.info("open files limit raised from %d to %d (the hard limit)", soft, wanted)
    else:
        logger.info("open files limit: %d", soft)


def setting_source(
    name: str, config_file: Path | None, flags: dict[str, Any], *, in_file: set[str] | None = None
) -> str:
    """Where setting `name`'s value was given, as a message names it so that the fix is made there: its
    flag, its `INFERPROXY_` variable, or the config file's key (its flag and variable both, for a default)."""
    in_file = config_file_keys(config_file) if in_file is None else in_file
    env_name = f"INFERPROXY_{name.upper()}"
    if name in Settings.model_fields and flags.get(name) is not None:
        return flag_name(name)
    if name in Settings.model_fields and env_name in {key.upper() for key in os.environ}:
        return env_name
    if name in in_file:
        return f"{config_file}: {name}"
    if name in Settings.model_fields:
        return f"{flag_name(name)} / {env_name}"
    return name


def describe_errors(exc: ValidationError, config_file: Path | None = None, flags: dict[str, Any] | None = None) -> str:
    """One line per bad setting: where its value came from, what is wrong and the value given.

    A value from the config file is named as the file's key, so that the fix is made where the
    value was written; otherwise the flag and the environment variable are both named.
    """
    flags = flags or {}
    in_file = config_file_keys(config_file)
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        where = setting_source(name, config_file, flags, in_file=in_file)
        if error["type"] == "extra_forbidden":  # a config file's key: every flag and variable is a setting
            lines.append(
                f"  {config_file}: {unknown_setting(name)}" if name in in_file else f"  {unknown_setting(name)}"
            )
            continue
        given = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
        if ", got " in error["msg"]:  # the validator's own message shows the value it refused
            given = ""
        # pydantic prefixes a validator's own message with "Value error, ": the message says it all
        lines.append(without_secrets(f"  {where}: {error['msg'].removeprefix('Value error, ')}{given}", error))
    return "\n".join(lines)


#: The settings whose values may hold credentials: keys, and URLs with `user:password@` or a signed query.
SECRET_SETTINGS = {"api_key": False, "upstream_api_key": False, "upstream": True, "output": True}


def without_secrets(line: str, error: Any) -> str:
    """`line`, about a bad value of `error`'s setting, with the credentials that value holds as `***`."""
    from app.checkpoints.output import scrub

    name = str(error["loc"][0]) if error["loc"] else ""
    if name not in SECRET_SETTINGS or not error.get("input"):
        return line
    given = error["input"]
    if not SECRET_SETTINGS[name]:  # a key, whole: as given, and as its repr shows it
        return line.replace(repr(str(given))[1:-1], "***").replace(str(given), "***")
    for value in given if isinstance(given, list) else str(given).split(","):
        if isinstance(value, str) and value.strip():
            line = scrub(line, value.strip())
    return line


def warn_of_unknown_variables(command: str) -> None:
    """A line on stderr for each `INFERPROXY_` variable that is no setting: misspelt, it would be ignored
    without a word (a config file's unknown key is refused; a variable may be another tool's)."""
    for line in unknown_variables(os.environ):
        print(f"inferproxy {command}: warning: {line}", file=sys.stderr)


def check_checkpoints_dir(settings: Settings, name: str = "--checkpoints-dir") -> None:
    """Refuse to start, before serving anything, on a checkpoints dir that cannot take files (or has no
    room for them), or holds checkpoints written with another records_per_chunk; `name` says where it
    was given."""
    from app.checkpoints.output import check_folder
    from app.checkpoints.resume import check_records_per_chunk
    from app.store.layout import CheckpointsLayout

    check_folder(str(settings.checkpoints_dir), name, room=True)
    check_records_per_chunk(CheckpointsLayout(str(settings.checkpoints_dir)), settings.records_per_chunk, record=False)


def check_output_apart(settings: Settings, name: str = "--output") -> None:
    """Refuse a local output whose chunks may land among the checkpoint files, which the proxy deletes once
    published: the output is the checkpoints dir or inside it (`--output-filename
    '${rank}/chunk_${chunk_index}.jsonl'` makes the rank's chunk file its own publication), or holds it and
    the output filename's folders lead into it (`ckpt/${rank}/...` with the checkpoints in `OUTPUT/ckpt`)."""
    from app.checkpoints.output import is_remote

    if is_remote(settings.output):
        return
    output = Path(os.path.realpath(settings.output.removeprefix("file://")))
    checkpoints = Path(os.path.realpath(settings.checkpoints_dir))
    if output.is_relative_to(checkpoints):
        raise ValueError(
            f"{name} {settings.output} is inside the checkpoints dir {settings.checkpoints_dir} (or is it): chunks "
            f"published there could be checkpoint files, which are deleted once published: give an output "
            f"folder outside it"
        )
    if not checkpoints.is_relative_to(output):
        return
    inside = checkpoints.relative_to(output).parts
    literal = settings.output_filename.split("$", 1)[0]  # the folders named before any ${...}
    folders = Path(os.path.normpath(literal.rsplit("/", 1)[0])).parts if "/" in literal else ()
    shared = min(len(inside), len(folders))
    if folders and inside[:shared] == folders[:shared]:
        raise ValueError(
            f"--output-filename {settings.output_filename!r} puts chunks under {os.path.join(*folders)} in "
            f"{name} {settings.output}, which holds the checkpoints dir {settings.checkpoints_dir}: chunks "
            f"published there could be checkpoint files, which are deleted once published: give an output "
            f"filename or folder apart from it"
        )


def run_batch(args: argparse.Namespace) -> int:
    from app.tools.run_batch import UPSTREAM_WAIT_S, Options, RunBatchError, main, state_dir

    flags = {name: getattr(args, name, None) for name in Settings.model_fields}
    config_file = config_file_path(args.config)
    warn_of_unknown_variables("run-batch")  # first: a misspelt one may be why what follows fails
    try:
        settings = Settings.load(args.config, **flags)
        given = settings.checkpoints_dir if "checkpoints_dir" in settings.model_fields_set else None
        state = state_dir(args.output_file, given)
    except ValidationError as exc:
        print(f"inferproxy run-batch: invalid settings:\n{describe_errors(exc, config_file, flags)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RunBatchError) as exc:
        print(f"inferproxy run-batch: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    wait_s = UPSTREAM_WAIT_S if args.upstream_wait_s is None else args.upstream_wait_s
    return main(Options(args.input_file, args.output_file, settings, state, wait_s))


def inspect(args: argparse.Namespace) -> int:
    import json

    from app.tools.inspect import inspect_dir, render, to_json

    if args.output_filename and not args.output:
        print("inferproxy inspect: --output-filename names files in --output: give --output too", file=sys.stderr)
        return 2
    try:
        report = inspect_dir(
            args.checkpoints_dir,
            ranks=args.rank,
            records_per_chunk=args.records_per_chunk,
            output=args.output,
            output_filename=args.output_filename,
        )
    except ValueError as exc:  # not a checkpoints dir, or an output that cannot be looked at
        print(f"inferproxy inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(report), indent=2) if args.json else render(report))
    return 0


def fake_upstream(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from app.tools.fake_upstream import FakeUpstream

    # Listen before saying so: a busy port fails in one line, without a banner claiming a server, and
    # `--port 0` prints the port actually taken.
    try:
        listening = socket.create_server((args.host, args.port), backlog=2048)
    except OSError as exc:
        print(f"inferproxy fake-upstream: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = listening.getsockname()[1]
    app = FakeUpstream(latency_ms=args.latency_ms, model=args.model)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        access_log=False,
        server_header=False,
        log_level="warning",
    )
    print(
        f"inferproxy fake-upstream: a vLLM-shaped simulator of {args.model!r} on http://{args.host}:{port}/v1 "
        f"({args.latency_ms:g} ms per answer)",
        file=sys.stderr,
        flush=True,
    )
    with listening:
        uvicorn.Server(config).run(sockets=[listening])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`inferproxy ...`. A reader that stops reading its output early (`inferproxy status --once | head -1`)
    ends it quietly with exit code 1, as other commands in a pipe do, rather than with a traceback."""
    try:
        code = dispatch(argv)
        sys.stdout.flush()  # inside the `try`: a write left for the interpreter's exit would fail out of reach
        return code
    except BrokenPipeError:
        # stdout is flushed once more at exit: send what is left of it nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def dispatch(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "run-batch":
        return run_batch(args)
    if args.command == "fake-upstream":
        return fake_upstream(args)
    if args.command == "inspect":
        return inspect(args)
    if args.command == "status":
        api_key = args.api_key or os.environ.get("INFERPROXY_API_KEY") or None
        return status.main(
            args.url, api_key=api_key, once=args.once, raw=args.json, sort=args.sort, timeout_s=args.timeout
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    common = {
        "documents": args.documents,
        "rollouts": args.rollouts,
        "records_per_chunk": args.records_per_chunk,
        "concurrency": args.concurrency,
        "model": args.model,
    }
    if args.command == "demo":
        options = demo.DemoOptions(
            workdir=args.workdir,
            kills=args.kills,
            kill_proxy=args.kill_proxy,
            latency_ms=args.latency_ms,
            upstream=args.upstream,
            seed=args.seed,
            **common,
        )
        return demo.main(options)
    return demo.job_main(demo.DemoOptions(proxy=args.proxy, pause_at=args.pause_at, **common))


if __name__ == "__main__":
    sys.exit(main())
