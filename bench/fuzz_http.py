"""The long differential fuzz run of app.http against h11 (`make fuzz`).

Unlike the tests, it does not stop at the first divergence: it runs `--examples` request
streams and as many answers, collects every finding, keeps the shortest input for each
(kind, mutation), and prints them, excused ones (tests/http/test_fuzz.py's LENIENCIES and
KNOWN_DIVERGENCES) apart. Exit status 1 if any finding is not excused.

    .venv/bin/python bench/fuzz_http.py [--examples 20000] [--seed N] [--only server|client]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.http.test_fuzz import client_findings, excuse, server_findings
from tests.http_fuzz import Finding, Part, request_streams, response_streams


class Collector:
    def __init__(self) -> None:
        self.shortest: dict[tuple[str, str, str], tuple[bytes, Finding, list[bytes]]] = {}
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.tags: dict[tuple[str, str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.runs = 0

    def add(self, side: str, data: bytes, pieces: list[bytes], findings: list[Finding]) -> None:
        self.runs += 1
        for finding in findings:
            key = (side, finding.kind, finding.part.mutation or "valid")
            self.counts[key] += 1
            self.tags[key].update(finding.part.tags - {finding.part.mutation})
            if key not in self.shortest or len(data) < len(self.shortest[key][0]):
                self.shortest[key] = (data, finding, pieces)

    def report(self) -> int:
        failures = 0
        for key in sorted(self.shortest, key=lambda k: (excuse(self.shortest[k][1]) is not None, k)):
            data, finding, pieces = self.shortest[key]
            reason = excuse(finding)
            failures += reason is None
            side, kind, mutation = key
            verdict = f"excused: {reason}" if reason else "FAILURE"
            print(f"\n[{verdict}] {side} {kind} {mutation} x{self.counts[key]}")
            print(f"  with   {dict(self.tags[key].most_common(8))}")
            print(f"  input  {data!r}")
            if len(pieces) > 1:
                print(f"  pieces {pieces!r}")
            print(f"  {finding.detail[:600]}")
        print(f"\n{self.runs} runs, {len(self.shortest)} distinct findings, {failures} not excused")
        return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--only", choices=["server", "client"])
    args = parser.parse_args()
    collector = Collector()
    options = settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )

    @hypothesis_seed(args.seed)
    @options
    @given(request_streams())
    def server(stream: tuple[list[Part], list[bytes]]) -> None:
        parts, pieces = stream
        collector.add("server", b"".join(pieces), pieces, server_findings(parts, pieces))

    @hypothesis_seed(args.seed)
    @options
    @given(response_streams())
    def client(stream: tuple[bytes, list[Part], list[bytes]]) -> None:
        method, parts, pieces = stream
        collector.add(f"client {method.decode()}", b"".join(pieces), pieces, client_findings(method, parts, pieces))

    print(f"seed {args.seed}, {args.examples} examples per side")
    started = time.monotonic()
    if args.only != "client":
        server()
    if args.only != "server":
        client()
    print(f"{time.monotonic() - started:.0f} s")
    return 1 if collector.report() else 0


if __name__ == "__main__":
    sys.exit(main())
