"""SIGTERM in the middle of a publication, and the ranks taken over by another proxy while it drains.

Two `inferproxy serve` processes (each with its own data dir and log) share one checkpoints dir and one
output; the four ranks' jobs (`RankJob`, two riding through, two starting over from `/resume`) talk to
a `Forwarder` in front of them. At moments drawn by progress from the seed, the current proxy's output is
slowed (`faulty_serve`: each open under it sleeps) until a publication is under way, the proxy gets
SIGTERM, and the front sends new connections to the other proxy at once: it answers 409
`rank_owned_error` (retried by the jobs, rollouts included) until the draining one gives each rank up,
then takes the rank over from the disk. The stopped proxy must exit 0, and is restarted to be the next
one's successor (the jobs start no document meanwhile: `Run.jobs_held`). On half the hand-overs (drawn)
the new proxy is SIGKILLed as soon as the old one has exited, so that no proxy runs and what is on disk
is checked at rest. The run ends in `Run.finish`: nothing acknowledged lost or published twice, no
answer lost from the cache across a hand-over.
Short mode: 8 hand-overs; `--chaos-long`: 30.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.conftest import Chaos
from tests.chaos.harness import Forwarder, ProxyProcess, RankJob, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger

pytestmark = pytest.mark.chaos

RANKS = 4
RECORDS_PER_CHUNK = 10
FLUSH_INTERVAL_MS = 50
SETTLE_S = 1.0
#: Shorter than some of the stalls drawn: a publication is then given up, or keeps its rank's lock until
#: the process exits (contract §2), and the new proxy must wait for it either way.
SHUTDOWN_GRACE_S = 2


async def test_sigterm_mid_publication_then_takeover_by_another_proxy_breaks_no_invariant(
    tmp_path: Path, chaos: Chaos
) -> None:
    handovers = chaos.count(8, 30)
    documents = chaos.count(299, 999)  # not a whole number of chunks: the last ones stay open till the end
    rng = chaos.rng("handovers")
    killed = set(rng.sample(range(handovers), handovers // 2))
    upstream = UpstreamProcess(tmp_path, latency_ms=5)
    upstream.start()
    front = Forwarder(0)
    try:
        await upstream.ready()
        await front.start()
        shared = {"checkpoints": tmp_path / "checkpoints", "output": tmp_path / "output"}
        proxies = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            extra = (f"--records-per-chunk={RECORDS_PER_CHUNK}", f"--shutdown-grace-s={SHUTDOWN_GRACE_S}")
            proxies.append(ProxyProcess(tmp_path / name, [upstream.url], *extra, **shared))
        inputs = {rank: [f"r{rank}-doc-{i}" for i in range(documents)] for rank in range(RANKS)}
        ledger = Ledger(inputs, RECORDS_PER_CHUNK, replay_window_s=FLUSH_INTERVAL_MS / 1000 + SETTLE_S)
        jobs = [RankJob(front.url, ledger, rank, restarts=rank % 2 == 1) for rank in range(RANKS)]
        total = RANKS * documents
        async with chaos_run(proxies[0], ledger, jobs, standby=proxies[1:], front=front) as run:
            points = sorted(rng.sample(range(total // 10, total * 6 // 10), handovers))
            for number, point in enumerate(points):
                await run.until(lambda point=point: ledger.acks() >= point, f"{point} acknowledged documents")
                await run.hand_over(rng.uniform(1.0, 3.0), kill_the_new_one=number in killed)
            await run.finish()
        assert len(run.handovers) == handovers
        assert any(run.handovers), "no SIGTERM landed while a publication was under way"
        assert all(front.connections[proxy.port] for proxy in proxies), f"a proxy never served: {front.connections}"
        assert len(ledger.deaths) == len(killed) + 1  # and the last one, in `finish`
    finally:
        await front.close()
        upstream.close()
