"""Takes the README's picture of the live page (docs/page.png) during a demo-like run: four ranks with
declared totals, the first part of each one's answers already in the cache (a restarted job), and a fake
upstream that takes 300 ms per answer; the shot is taken while the jobs run.

    .venv/bin/python -m tests.page_screenshot docs/page.png
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from tests.browser import browser, chromium_path
from tests.jobs import run_rank, settings
from tests.servers import fake_upstream, serve_proxy

#: rank: (documents, declared total, answers cached, documents in flight)
RANKS = {0: (2000, 2000, 700, 24), 1: (2500, 2500, 500, 16), 2: (3000, 3000, 300, 12), 3: (1200, 4000, 0, 8)}
WATCHED_S = 40.0


async def main(picture: Path) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        work = Path(workdir)
        async with (
            fake_upstream(latency_ms=300) as (url, _),
            serve_proxy(settings(work, url, records_per_chunk=100)) as proxy,
        ):
            jobs = [
                asyncio.create_task(run_rank(proxy, rank, n, total=total, cached=cached, concurrency=concurrency))
                for rank, (n, total, cached, concurrency) in RANKS.items()
            ]
            async with browser(chromium_path(), work) as chromium:
                page = await chromium.open(proxy + "/", width=1400, height=900)
                await asyncio.sleep(WATCHED_S)
                await page.screenshot(picture)
                if page.errors:
                    raise RuntimeError(f"the page logged errors: {page.errors}")
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
