"""The `inferproxy` command.

inferproxy demo [--documents N] [--rollouts R] [--kills K] ...   the quickstart
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from app import __version__, demo


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = demo.DemoOptions()
    parser.add_argument("--workdir", type=Path, default=defaults.workdir, help="where checkpoints and output go")
    parser.add_argument("--documents", type=_positive, default=defaults.documents)
    parser.add_argument("--rollouts", type=_positive, default=defaults.rollouts, help="generations per document")
    parser.add_argument("--records-per-chunk", type=_positive, default=defaults.records_per_chunk)
    parser.add_argument("--latency-ms", type=float, default=defaults.latency_ms, help="simulated generation time")
    parser.add_argument("--concurrency", type=_positive, default=defaults.concurrency)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferproxy", description="Caching and checkpointing for batch inference.")
    parser.add_argument("--version", action="version", version=f"inferproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo_parser = commands.add_parser("demo", help="kill a batch job with SIGKILL, restart it, check the output")
    _demo_arguments(demo_parser)
    demo_parser.add_argument("--kills", type=_non_negative, default=demo.DemoOptions().kills)
    demo_parser.add_argument("--seed", type=int, default=None, help="fixes the kill moments")

    job_parser = commands.add_parser("demo-job", help="the job `demo` runs (one run of it)")
    _demo_arguments(job_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = demo.DemoOptions(
        workdir=args.workdir,
        documents=args.documents,
        rollouts=args.rollouts,
        records_per_chunk=args.records_per_chunk,
        kills=getattr(args, "kills", 0),
        latency_ms=args.latency_ms,
        concurrency=args.concurrency,
        seed=getattr(args, "seed", None),
    )
    if args.command == "demo":
        return demo.main(options)
    return demo.job_main(options)


if __name__ == "__main__":
    sys.exit(main())
