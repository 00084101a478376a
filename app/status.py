"""`inferproxy status [URL]`: a running proxy's `/stats` in the terminal (docs/contract.md §10).

On a terminal the screen is cleared and redrawn every `REFRESH_S` until Ctrl-C; with `--once`, or
where stdout is not a terminal, one snapshot is printed; `--json` prints `/stats` as it came. An
unreachable proxy is one line and exit code 1 for a single snapshot, and "retrying" above the last
numbers while refreshing. A missing or refused API key ends either (trying again cannot help).

The numbers are formatted as the live page formats them (1.2k, 3.4M, 62.3%, 2h 03m): its JavaScript
(app/static/page.html) has the same rules, and both round halves up, so that they show the same text.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

import orjson

DEFAULT_URL = "http://127.0.0.1:8080"
REFRESH_S = 2.0
TIMEOUT_S = 5.0
#: Cursor home, then erase the screen.
CLEAR = "\x1b[H\x1b[2J"
BAR_WIDTH = 20

Rank = dict[str, Any]

#: Orders of the ranks; a rank with nothing to sort on goes last, ties by rank (the page's orders).
SORTS: dict[str, Callable[[Rank], tuple[Any, ...]]] = {
    "rank": lambda r: (r["rank"],),
    "progress": lambda r: (r["progress"] is None, r["progress"] or 0.0, r["rank"]),
    "eta": lambda r: (r["eta_s"] is None, -(r["eta_s"] or 0.0), r["rank"]),
    "rate": lambda r: (r["documents_per_s"] is None, r["documents_per_s"] or 0.0, r["rank"]),
}


class StatusError(Exception):
    """`/stats` could not be read; `final` where trying again cannot help."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


# -- formatting (the page's rules) ----------------------------------------------------------------


def _half_up(x: float, digits: int) -> str:
    scale = 10**digits
    return f"{math.floor(x * scale + 0.5) / scale:.{digits}f}"


def count(n: float | None) -> str:
    """950, 1.2k, 34.5k, 123k, 3.4M: three significant figures at most."""
    if n is None:
        return "—"
    text = _half_up(n, 0)
    if float(text) < 1000:
        return text
    value, text, unit = float(n), "", ""
    for prefix in "kMGTP":
        value /= 1000
        text, unit = _half_up(value, 1), prefix
        if float(text) >= 100:
            text = _half_up(value, 0)
        if float(text) < 1000:
            break
    return text.removesuffix(".0") + unit


def percent(ratio: float | None) -> str:
    return "—" if ratio is None else _half_up(ratio * 100, 1) + "%"


def duration(seconds: float | None) -> str:
    """42s, 12m 05s, 2h 03m, 3d 04h."""
    if seconds is None:
        return "—"
    t = math.floor(seconds + 0.5)
    if t < 60:
        return f"{t}s"
    if t < 3600:
        return f"{t // 60}m {t % 60:02d}s"
    if t < 86400:
        return f"{t // 3600}h {t % 3600 // 60:02d}m"
    return f"{t // 86400}d {t % 86400 // 3600:02d}h"


def rate(per_second: float | None) -> str:
    """0.42, 3.17, 45.2, 1.2k (per second)."""
    if per_second is None:
        return "—"
    for digits, below in ((2, 10), (1, 100)):
        text = _half_up(per_second, digits)
        if float(text) < below:
            return text
    return count(per_second)


def latency(seconds: float | None) -> str:
    """25 ms, 2.5 s."""
    if seconds is None:
        return "—"
    milliseconds = _half_up(seconds * 1000, 0)
    if float(milliseconds) < 1000:
        return milliseconds + " ms"
    return _half_up(seconds, 1).removesuffix(".0") + " s"


def size(num_bytes: int | None) -> str:
    return "—" if num_bytes is None else count(num_bytes) + "B"


# -- reading /stats ---------------------------------------------------------------------------------


def stats_url(url: str) -> str:
    """`/stats` under the proxy's URL (a path prefix kept); `host:port` is taken as http."""
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/") + "/stats"


def fetch(url: str, api_key: str | None) -> bytes:
    """`/stats`' body, or `StatusError` saying what went wrong in one line."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(stats_url(url), headers=headers), timeout=TIMEOUT_S
        ) as answer:
            body: bytes = answer.read()
            return body
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 401 and api_key:
            raise StatusError(f"{url} refused the API key given (401)", final=True) from None
        if exc.code == 401:
            raise StatusError(
                f"{url} needs its API key (401): pass --api-key or set INFERPROXY_API_KEY", final=True
            ) from None
        raise StatusError(f"GET {stats_url(url)} answered {exc.code}: is {url} an inferproxy?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise StatusError(f"cannot reach {url}: {reason}") from None


def decode(body: bytes, url: str) -> dict[str, Any]:
    try:
        stats = orjson.loads(body)
    except orjson.JSONDecodeError:
        stats = None
    if not isinstance(stats, dict) or "totals" not in stats:
        raise StatusError(f"GET {stats_url(url)} did not answer inferproxy's JSON: is {url} an inferproxy?")
    return stats


# -- the snapshot as lines ------------------------------------------------------------------------


def render(stats: dict[str, Any], url: str, *, sort: str = "rank", height: int | None = None) -> list[str]:
    """The snapshot as lines of text; with `height`, rank rows are cut to fit it (a line says how many)."""
    totals = stats["totals"]
    rates = stats["rates"]
    ranks: list[Rank] = stats["ranks"]
    saved = totals["hits"] + totals["coalesced"]
    clock = time.strftime("%H:%M:%S", time.localtime(stats["now"]))
    head = [
        f"inferproxy {stats['version']} at {url} · up {duration(stats['uptime_s'])} · {clock}",
        "",
        f"hit ratio {percent(totals['hit_ratio'])} · tokens saved {count(totals['tokens_saved'])}"
        f" · generations saved {count(saved)} · {rate(rates.get('requests_per_s'))} requests/s"
        f" · {rate(rates.get('documents_per_s'))} documents/s · {count(stats['in_flight'])} in flight",
        _documents_done(ranks),
        "",
    ]
    upstreams = _table(
        ["upstream", "health", "in flight", "requests", "errors", "retries", "p50", "p99"],
        [
            [
                u["url"],
                "healthy" if u["healthy"] else "DOWN",
                count(u["in_flight"]),
                count(u["requests"]),
                count(u["errors"]),
                count(u["retries"]),
                latency(u["latency_p50_s"]),
                latency(u["latency_p99_s"]),
            ]
            for u in stats["upstreams"]
        ],
        left=2,
    )
    rows = [_rank_row(r) for r in sorted(ranks, key=SORTS[sort])]
    header = ["rank", "progress", "docs/s", "ETA", "chunks", "from cache", "generated", "tokens saved"]
    table = _table(header, rows, left=2) if rows else ["no job has talked to this proxy since it started"]
    if height is not None:
        room = max(height - len(head) - len(upstreams) - 2, 2)  # the blank line, the "more" line
        if len(table) > room:
            hidden = len(table) - room
            table = [*table[:room], f"… {hidden} more ranks (--sort progress: least done first; --once: all)"]
    return [*head, *table, "", *upstreams]


def _documents_done(ranks: list[Rank]) -> str:
    done = sum(r["done_documents"] for r in ranks if r["done_documents"] is not None)
    declared = [r["total_documents"] for r in ranks if r["total_documents"] is not None]
    if not ranks:
        return "no job yet"
    if len(declared) < len(ranks):
        return f"documents done {count(done)} on {len(ranks)} ranks (totals declared by {len(declared)})"
    total = sum(declared)
    unfinished = [r["eta_s"] for r in ranks if r["progress"] != 1]
    if not unfinished:
        eta = "finished"
    elif None in unfinished:
        eta = "ETA —"
    else:
        eta = "ETA " + duration(max(unfinished))
    finished = len(ranks) - len(unfinished)
    progress = percent(min(done / total, 1.0) if total else 1.0)
    return f"documents done {count(done)} / {count(total)} ({progress}) · {eta} · {finished} of {len(ranks)} finished"


def _rank_row(r: Rank) -> list[str]:
    done, total = r["done_documents"], r["total_documents"]
    if done is None:
        progress = "nothing checkpointed yet"
    elif total is None:
        progress = f"{count(done)} done (no total declared)"
    else:
        filled = math.floor(min(r["progress"], 1.0) * BAR_WIDTH)
        bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
        progress = f"{bar} {count(done)} / {count(total)} · {percent(r['progress'])}"
    return [
        str(r["rank"]),
        progress,
        rate(r["documents_per_s"]),
        "done" if r["progress"] == 1 else duration(r["eta_s"]),
        count(r["chunks_published"]),
        count(r["hits"] + r["coalesced"]),
        count(r["misses"]),
        count(r["tokens_saved"]),
    ]


def _table(header: list[str], rows: list[list[str]], *, left: int) -> list[str]:
    """Columns padded to their widest cell: the first `left` to the left, numbers to the right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()
        for cells in (header, *rows)
    ]


# -- the command ------------------------------------------------------------------------------------


def main(url: str, *, api_key: str | None, once: bool, raw: bool, sort: str, out: TextIO = sys.stdout) -> int:
    if not (once or raw) and out.isatty():
        try:
            return watch(url, api_key, sort, out)
        except KeyboardInterrupt:  # Ctrl-C is how one stops watching: quietly
            out.write("\n")
            return 0
    try:
        body = fetch(url, api_key)
        text = body.decode() if raw else "\n".join(render(decode(body, url), url, sort=sort))
    except StatusError as exc:
        print(f"inferproxy status: {exc}", file=sys.stderr)
        return 1
    print(text, file=out)
    return 0


def watch(url: str, api_key: str | None, sort: str, out: TextIO) -> int:
    """Redraw every `REFRESH_S`; while the proxy does not answer, say so above its last numbers."""
    last: list[str] = []
    last_at = 0.0
    while True:
        columns, lines = shutil.get_terminal_size()
        try:
            frame = last = render(decode(fetch(url, api_key), url), url, sort=sort, height=lines - 2)
            last_at = time.monotonic()
        except StatusError as exc:
            if exc.final:
                print(f"inferproxy status: {exc}", file=sys.stderr)
                return 1
            since = f" (numbers from {duration(time.monotonic() - last_at)} ago)" if last else ""
            frame = [f"disconnected, retrying every {REFRESH_S:g} s: {exc}{since}", *last]
        out.write(CLEAR + "\n".join(line[:columns] for line in frame[: lines - 1]) + "\n")
        out.flush()
        time.sleep(REFRESH_S)
