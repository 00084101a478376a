"""How often the load bound splits a document's rollouts: a simulation of `app.service.affinity.choose`.

A job keeps `--in-flight` requests going; documents come one after another, each with its `--rollouts`
rollouts; each request takes an exponentially distributed time (mean 1) on its replica. Printed: the share
of documents whose rollouts all went to one replica, per load bound and requests in flight (mean over
`--seeds` runs). No process, no socket: the choice itself, as the proxy makes it.

    .venv/bin/python bench/sim_load_bound.py [--documents 200] [--rollouts 4] [--replicas 2] [--min-bound 16]
"""

from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass

from app.service.affinity import MIN_BOUND, choose, replica_seed


@dataclass
class Node:
    seed: int
    in_flight: int = 0


def together(
    in_flight: int, bound: float, *, documents: int, rollouts: int, replicas: int, seed: int, min_bound: int
) -> float:
    rng = random.Random(seed)
    nodes = [Node(replica_seed(f"http://replica-{i}:8000")) for i in range(replicas)]
    work = [(d, r) for d in range(documents) for r in range(rollouts)]
    busy: list[tuple[float, int]] = []
    placed: dict[int, set[int]] = {}
    now, sent = 0.0, 0
    while sent < len(work) or busy:
        while sent < len(work) and sum(n.in_flight for n in nodes) < in_flight:
            doc, _ = work[sent]
            sent += 1
            chosen, _ = choose(f"doc-{doc}".encode(), nodes, bound, min_bound)
            chosen.in_flight += 1
            index = nodes.index(chosen)
            placed.setdefault(doc, set()).add(index)
            heapq.heappush(busy, (now + rng.expovariate(1.0), index))
        now, index = heapq.heappop(busy)
        nodes[index].in_flight -= 1
    return sum(1 for where in placed.values() if len(where) == 1) / documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--min-bound", type=int, default=MIN_BOUND, help="the floor of the bound (0: none, as before it had one)"
    )
    args = parser.parse_args()
    bounds = (0.1, 0.25, 0.5, 1.0)
    print("| in flight | " + " | ".join(f"bound {b:g}" for b in bounds) + " |")
    print("| ---: | " + " | ".join("---:" for _ in bounds) + " |")
    for in_flight in (4, 8, 16, 32, 64, 128, 256):
        shares = [
            sum(
                together(
                    in_flight,
                    bound,
                    documents=args.documents,
                    rollouts=args.rollouts,
                    replicas=args.replicas,
                    seed=s,
                    min_bound=args.min_bound,
                )
                for s in range(args.seeds)
            )
            / args.seeds
            for bound in bounds
        ]
        print(f"| {in_flight} | " + " | ".join(f"{share:.1%}" for share in shares) + " |")


if __name__ == "__main__":
    main()
