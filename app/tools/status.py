"""`inferproxy status [URL]`: a running proxy's `/stats` in the terminal (docs/contract.md §10).

On a terminal the screen is cleared and redrawn every `REFRESH_S` until Ctrl-C; with `--once`, or
where stdout is not a terminal, one snapshot is printed; `--json` prints `/stats`' JSON object. An
unreachable proxy is one line and exit code 1 for a single snapshot, and "retrying" above the last
numbers while refreshing. A missing or refused API key ends either (trying again cannot help); a key no
header can carry (a line break) and a URL with a query are refused before any request, with exit code 2.
A rank's chunks waiting for the output (and why, while publishing them fails) and chunks lost from it
are a column and lines under the ranks table, as the page has them; older proxies' /stats lack them.
A rank whose last chunk is published is "finished", and a line says whether the whole job is (every rank
it declared with X-Total-Ranks); older proxies' /stats lack these too.

Whatever answers at the URL is not trusted: a redirect is not followed (the API key would go
along), a fetch has a deadline and a size bound, an answer that is not `/stats` is one line saying
what is wrong with it, and every string shown has its control characters escaped.

The numbers are formatted as the live page formats them (1.2k, 3.4M, 62.3%, 2h 03m): its JavaScript
(app/service/static/page.html) has the same rules, and both round halves up, so that they show the same text.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import orjson

from app.checkpoints.output import redact_url
from app.service.settings import header_safe_key
from app.tools.terminal import printable

DEFAULT_URL = "http://127.0.0.1:8080"
REFRESH_S = 2.0
#: The whole of one fetch of /stats: connecting, the answer's head and its body.
TIMEOUT_S = 10.0
#: A /stats body larger than this is not one (a proxy's is a few KiB per rank).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Cursor home, then erase the screen.
CLEAR = "\x1b[H\x1b[2J"
BAR_WIDTH = 20

Rank = dict[str, Any]

#: Orders of the ranks; a rank with nothing to sort on goes last, ties by rank (the page's orders).
SORTS: dict[str, Callable[[Rank], tuple[Any, ...]]] = {
    "rank": lambda r: (r["rank"],),
    "progress": lambda r: (r.get("progress") is None, r.get("progress") or 0.0, r["rank"]),
    "eta": lambda r: (r.get("eta_s") is None, -(r.get("eta_s") or 0.0), r["rank"]),
    "rate": lambda r: (r.get("documents_per_s") is None, r.get("documents_per_s") or 0.0, r["rank"]),
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
    """950, 1.2k, 34.5k, 123k, 3.4M: three significant figures at most (1e+18 from there on)."""
    if n is None:
        return "—"
    if n >= 1e18:
        return f"{n:.3g}"
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
    """62.3%, of a ratio taken between 0 and 1."""
    return "—" if ratio is None else _half_up(min(max(ratio, 0.0), 1.0) * 100, 1) + "%"


#: Durations from this on are shown as "> 999d".
LONGEST_S = 1000 * 86400


def duration(seconds: float | None) -> str:
    """42s, 12m 05s, 2h 03m, 3d 04h, > 999d."""
    if seconds is None:
        return "—"
    if seconds >= LONGEST_S:
        return "> 999d"
    t = math.floor(max(seconds, 0.0) + 0.5)
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
        if per_second < below:
            text = _half_up(per_second, digits)
            if float(text) < below:
                return text
    return count(per_second)


def latency(seconds: float | None) -> str:
    """25 ms, 2.5 s (and as a duration from 1000 s on)."""
    if seconds is None:
        return "—"
    if seconds >= 1000:
        return duration(seconds)
    milliseconds = _half_up(seconds * 1000, 0)
    if float(milliseconds) < 1000:
        return milliseconds + " ms"
    return _half_up(seconds, 1).removesuffix(".0") + " s"


def size(num_bytes: int | None) -> str:
    return "—" if num_bytes is None else count(num_bytes) + "B"


# -- reading /stats ---------------------------------------------------------------------------------


def stats_url(url: str) -> str:
    """`/stats` under the proxy's URL (a path prefix kept); `host:port` is taken as http. A fragment is dropped,
    as by every HTTP client (no request carries one: a page's URL copied from a browser may have it); a query is
    a `ValueError`: /stats takes none, and whether it was meant for something in front of the proxy is not known."""
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ValueError(f"{shown_url(url)} is no URL: {exc}") from None
    root = urlunsplit(parts._replace(query="", fragment=""))
    if parts.query:
        given = shown_url(urlunsplit(parts._replace(fragment="")))
        raise ValueError(
            f"{given} has a query: status takes the proxy's root URL and asks its /stats, which takes none: "
            f"try {shown_url(root)}"
        )
    return root.rstrip("/") + "/stats"


def shown_url(url: str) -> str:
    """`url` as status shows it: its credentials (`user:password@`, a query's values) as `***`, as the proxy's
    logs show them (`host:port` is left without a scheme)."""
    scheme = "" if "://" in url else "http://"
    try:
        return redact_url(scheme + url).removeprefix(scheme)
    except ValueError:  # no URL ("Invalid IPv6 URL"): a user:password@ in it is hidden all the same
        return re.sub(r"^([^:/?#]*://)?[^/?#]*@", r"\1***@", url)


def check_api_key(api_key: str | None) -> None:
    """`ValueError` for a key no `Authorization` header can carry (a control character: a line break, NUL)."""
    if api_key is not None and not header_safe_key(api_key):
        raise ValueError(
            "the API key given (--api-key or INFERPROXY_API_KEY) holds a control character (a line break?): "
            "a key is one line of text"
        )


def fetch(url: str, api_key: str | None, timeout_s: float = TIMEOUT_S) -> bytes:
    """`/stats`' body, or `StatusError` saying what went wrong in one line."""
    return asyncio.run(_fetch(url, api_key, timeout_s))


async def _fetch(url: str, api_key: str | None, timeout_s: float) -> bytes:
    from app.http.client import HTTPClient, HTTPClientError, ResponseTooLarge

    target = stats_url(url)
    where, asked = shown_url(url), shown_url(target)
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
    client = HTTPClient(
        connect_timeout=timeout_s, read_timeout=timeout_s, max_idle=0, max_response_bytes=MAX_BODY_BYTES
    )
    try:
        async with asyncio.timeout(timeout_s), client.request("GET", target, headers=headers) as answer:
            if answer.status == 200:
                return await answer.read()
            status, location = answer.status, answer.header(b"location")
    except TimeoutError:
        raise StatusError(f"{where} did not answer within {timeout_s:g} s (--timeout)") from None
    except ResponseTooLarge:
        raise StatusError(
            f"{where} did not answer with inferproxy's /stats: a body over {MAX_BODY_BYTES} bytes"
        ) from None
    except (HTTPClientError, ValueError) as exc:  # ValueError: not an http(s) URL
        reason = str(exc).replace(target, asked)
        raise StatusError(f"cannot reach {where}: {reason}", final=isinstance(exc, ValueError)) from None
    finally:
        await client.close()
    if status == 401 and api_key:
        raise StatusError(f"{where} refused the API key given (401)", final=True)
    if status == 401:
        raise StatusError(f"{where} needs its API key (401): pass --api-key or set INFERPROXY_API_KEY", final=True)
    if 300 <= status < 400:
        to = shown_url(location.decode("latin-1"))[:200] if location else "nowhere"
        raise StatusError(
            f"GET {asked} answered {status}, a redirect to {to}: not followed (the API key would go along); "
            f"give the proxy's own URL",
            final=True,
        )
    if status == 404 and target.endswith("/v1/stats"):  # the OpenAI clients' base_url, given as the proxy's
        raise StatusError(
            f"GET {asked} answered 404: status takes the proxy's root, not the /v1 base_url: "
            f"try {asked.removesuffix('/v1/stats')}",
            final=True,
        )
    raise StatusError(f"GET {asked} answered {status}: is {where} an inferproxy?")


class Added:
    """A key of `/stats` that older proxies do not send: checked where it is there, let go where it is not."""

    def __init__(self, shape: Any) -> None:
        self.shape = shape


#: The shape of `/stats` as `render` reads it (docs/contract.md §10); other keys are let through.
#: A key whose value may be null may also be missing (`render` reads it with `.get`), and so may an object
#: whose keys all may. Every key `render` reads is here: a value of another type is one line, not a traceback.
NUMBER, NUMBER_OR_NULL, TEXT_OR_NULL = "a number >= 0", "a number >= 0 or null", "text or null"
_UPSTREAM = {
    "url": str,
    "healthy": bool,
    **dict.fromkeys(("in_flight", "requests", "errors", "retries"), NUMBER),
    **dict.fromkeys(("latency_p50_s", "latency_p99_s"), NUMBER_OR_NULL),
    "spilled": Added(NUMBER),  # proxies before affinity routing have none
}
_RANK = {
    "rank": int,
    **dict.fromkeys(("hits", "coalesced", "misses", "tokens_saved", "chunks_published"), NUMBER),
    **dict.fromkeys(("done_documents", "total_documents", "progress", "eta_s", "documents_per_s"), NUMBER_OR_NULL),
    # the output's side of the rank (proxies before publications in the background have none of these)
    **dict.fromkeys(("chunks_waiting", "publication_attempts"), Added(NUMBER)),
    "publication_error": TEXT_OR_NULL,
    **dict.fromkeys(("publication_failing_since", "publication_retry_in_s"), NUMBER_OR_NULL),
    "chunks_lost": Added([int]),
    # proxies before finished ranks have none
    "finished": Added(bool),
    "finished_at": NUMBER_OR_NULL,
}
_BATCH = {
    "id": str,
    "status": str,
    **dict.fromkeys(("total", "completed", "failed", "in_flight", "lines_per_s"), NUMBER),
    "eta_s": NUMBER_OR_NULL,
    "hits": Added(NUMBER),  # proxies before the answers' cache have none
    "paused": TEXT_OR_NULL,  # proxies before a full disk paused batches have none
}
#: The final statuses of a batch, as `/stats`' `batches_done` counts them.
BATCH_ENDINGS = ("completed", "failed", "cancelled", "expired")
STATS_SHAPE: dict[str, Any] = {
    "version": str,
    **dict.fromkeys(("now", "uptime_s", "in_flight"), NUMBER),
    "totals": {**dict.fromkeys(("hits", "coalesced", "tokens_saved"), NUMBER), "hit_ratio": NUMBER_OR_NULL},
    "rates": dict.fromkeys(("requests_per_s", "documents_per_s"), NUMBER_OR_NULL),
    "routing": Added(str),  # proxies before affinity routing have none
    "upstreams": [_UPSTREAM],
    "ranks": [_RANK],
    "forgotten": {"ranks": NUMBER_OR_NULL},  # proxies before `max_tracked_ranks` have none
    "job": Added({"ranks_declared": NUMBER_OR_NULL, "ranks_finished": NUMBER, "finished": bool}),
    "batches": Added([_BATCH]),  # proxies before the Batch API have none
    # proxies before it have none (and a test's app without a batch engine {})
    "batches_done": Added(dict.fromkeys(BATCH_ENDINGS, Added(NUMBER))),
}


def decode(body: bytes, url: str) -> dict[str, Any]:
    """`/stats` checked against `STATS_SHAPE`, or `StatusError` saying what is wrong with it."""
    try:
        stats = orjson.loads(body)
        _check(stats, STATS_SHAPE, "")
    except (orjson.JSONDecodeError, _Wrong) as exc:
        wrong = f"not JSON ({exc})" if isinstance(exc, orjson.JSONDecodeError) else str(exc)
        raise StatusError(f"{url} did not answer with inferproxy's /stats: {wrong}") from None
    assert isinstance(stats, dict)
    return stats


class _Wrong(ValueError):
    """What in an answer is not as `/stats` has it."""


def _check(value: Any, shape: Any, where: str) -> None:
    if isinstance(shape, Added):
        _check(value, shape.shape, where)
    elif isinstance(shape, dict):
        if not isinstance(value, dict):
            raise _Wrong(f"{where or 'the answer'} is {_shown(value)}, not an object")
        for key, inner in shape.items():
            inside = f"{where}.{key}" if where else key
            if key in value:
                _check(value[key], inner, inside)
            elif not _may_be_missing(inner):
                raise _Wrong(f"{inside} is missing")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise _Wrong(f"{where} is {_shown(value)}, not a list")
        for i, item in enumerate(value):
            _check(item, shape[0], f"{where}[{i}]")
    elif shape == TEXT_OR_NULL:
        if value is not None and not isinstance(value, str):
            raise _Wrong(f"{where} is {_shown(value)}, not {shape}")
    elif shape in (NUMBER, NUMBER_OR_NULL):
        if value is None and shape == NUMBER_OR_NULL:
            return
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise _Wrong(f"{where} is {_shown(value)}, not {shape}")
    elif not isinstance(value, shape) or (shape is int and isinstance(value, bool)):
        raise _Wrong(f"{where} is {_shown(value)}, not {_KINDS[shape]}")


def _may_be_missing(shape: Any) -> bool:
    if isinstance(shape, dict):
        return all(_may_be_missing(inner) for inner in shape.values())
    return isinstance(shape, Added) or shape in (NUMBER_OR_NULL, TEXT_OR_NULL)


_KINDS = {str: "text", bool: "true or false", int: "an integer"}


def _shown(value: Any) -> str:
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    return orjson.dumps(value).decode()[:40]


# -- the snapshot as lines ------------------------------------------------------------------------


def render(stats: dict[str, Any], url: str, *, sort: str = "rank", height: int | None = None) -> list[str]:
    """The snapshot as lines of text; with `height`, rank rows are cut to fit it (a line says how many)."""
    totals = stats["totals"]
    rates = stats.get("rates", {})
    ranks: list[Rank] = stats["ranks"]
    saved = totals["hits"] + totals["coalesced"]
    try:
        clock = time.strftime("%H:%M:%S", time.localtime(stats["now"]))
    except (OverflowError, OSError, ValueError):  # a time no calendar of this platform reaches
        clock = "--:--:--"
    batches = stats.get("batches") or []
    ended = batches_done_line(stats.get("batches_done"))
    busy = bool(ranks or batches or ended)
    head = [
        f"inferproxy {printable(stats['version'])} at {printable(url)} · up {duration(stats['uptime_s'])} · {clock}",
        "",
        f"hit ratio {percent(totals.get('hit_ratio'))} · tokens saved {count(totals['tokens_saved'])}"
        f" · generations saved {count(saved)} · {rate(rates.get('requests_per_s'))} requests/s"
        f" · {rate(rates.get('documents_per_s'))} documents/s · {count(stats['in_flight'])} in flight",
        *([_documents_done(ranks)] if ranks or not busy else []),  # "no job yet", unless batches ran
        *([line] if (line := job_line(stats.get("job"))) else []),
        *([ended] if ended else []),
        *_forgotten(stats.get("forgotten", {}).get("ranks")),
        "",
    ]
    # Which replica takes a request matters only among several: the routing is said then, as on the page.
    routing = stats.get("routing") if len(stats["upstreams"]) > 1 else None
    upstreams = _table(
        [
            f"upstream (routing: {printable(routing)})" if routing else "upstream",
            *("health", "in flight", "requests", "spilled", "errors", "retries", "p50", "p99"),
        ],
        [
            [
                printable(u["url"]),
                "healthy" if u["healthy"] else "DOWN",
                count(u["in_flight"]),
                count(u["requests"]),
                count(u.get("spilled", 0)),
                count(u["errors"]),
                count(u["retries"]),
                latency(u.get("latency_p50_s")),
                latency(u.get("latency_p99_s")),
            ]
            for u in stats["upstreams"]
        ],
        left=2,
    )
    ordered = sorted(ranks, key=SORTS[sort])
    rows = [_rank_row(r) for r in ordered]
    # "published here": by this process, not the rank's chunks (a restarted proxy counts from zero)
    header = ["rank", "progress", "docs/s", "ETA", "published here", "from cache", "generated", "tokens saved"]
    outputs = [_output_cell(r) for r in ordered]
    if any(outputs):  # a column of its own only while some rank's chunks wait for the output, or are lost
        header.insert(5, "output")
        for row, cell in zip(rows, outputs, strict=True):
            row.insert(5, cell)
    idle = [] if busy else ["no job has talked to this proxy since it started"]
    table = _table(header, rows, left=2) if rows else idle
    notes = publication_notes(ranks, stats["now"])
    if height is not None:
        room = max(height - len(head) - len(upstreams) - 2, 2)  # the blank line, the "more" line
        if notes:  # lost chunks first; at most half the room unless the table leaves more
            shown = max(min(len(notes), max((room - 1) // 2, room - 1 - len(table))), 1)
            if len(notes) > shown:
                more = len(notes) - shown + 1
                notes = [*notes[: shown - 1], f"… {more} more ranks whose chunks wait or are lost (--once: all)"]
            room = max(room - len(notes) - 1, 2)
        if len(table) > room:
            hidden = len(table) - room
            table = [*table[:room], f"… {hidden} more ranks (--sort progress: least done first; --once: all)"]
    running = _batch_table(batches)
    return [*head, *table, *(["", *notes] if notes else []), *(["", *running] if running else []), "", *upstreams]


def batches_done_line(done: dict[str, int] | None) -> str | None:
    """The batches that ended, by final status ("batches: 2 completed, 1 failed (GET /v1/batches)"), or None
    for none (and for a proxy too old to say); the page has the same line."""
    parts = [f"{count(n)} {name}" for name in BATCH_ENDINGS if (n := (done or {}).get(name))]
    return f"batches: {', '.join(parts)} (GET /v1/batches)" if parts else None


def _batch_table(batches: list[dict[str, Any]]) -> list[str]:
    """The batches this proxy runs: done, failed, rate, ETA."""
    rows = [
        [
            printable(b["id"]),
            printable(b["status"] + (" PAUSED" if b.get("paused") else "")),
            f"{count(b['completed'] + b['failed'])} / {count(b['total'])}"
            + (f" ({percent((b['completed'] + b['failed']) / b['total'])})" if b["total"] else ""),
            count(b["failed"]),
            count(b["in_flight"]),
            count(b.get("hits", 0)),
            rate(b["lines_per_s"]),
            duration(b.get("eta_s")),
        ]
        for b in batches
    ]
    header = ["batch", "status", "done", "failed", "in flight", "from cache", "lines/s", "ETA"]
    paused = [f"  {printable(b['id'])} is paused: {printable(b['paused'])}" for b in batches if b.get("paused")]
    return [*_table(header, rows, left=2), *paused] if rows else []


def _output_cell(r: Rank) -> str:
    """The rank's chunks not in the output: lost ones (GET /resume refuses the rank), waiting ones."""
    lost, waiting = len(r.get("chunks_lost") or ()), r.get("chunks_waiting") or 0
    return ", ".join([*([f"{count(lost)} LOST"] if lost else []), *([f"{count(waiting)} waiting"] if waiting else [])])


#: Lost chunks named in a line before the rest are counted.
LOST_SHOWN = 8


def publication_notes(ranks: list[Rank], now: float) -> list[str]:
    """One line per rank whose chunks are missing from the output, then one per rank whose publications
    fail (the page has the same lines)."""
    lost, failing = [], []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        if missing := r.get("chunks_lost"):
            if len(missing) == 1:
                which = f"chunk {missing[0]} is"
            else:
                named = ", ".join(str(c) for c in missing[:LOST_SHOWN])
                rest = f", … {len(missing) - LOST_SHOWN} more" if len(missing) > LOST_SHOWN else ""
                which = f"chunks [{named}{rest}] are"
            lost.append(
                f"rank {r['rank']}: {which} missing from the output: GET /resume refuses the rank (see the proxy's log)"
            )
        if (error := r.get("publication_error")) is not None:
            waiting = r.get("chunks_waiting") or 0
            since, retry_in = r.get("publication_failing_since"), r.get("publication_retry_in_s")
            attempts = r.get("publication_attempts") or 0
            tries = [f"{count(attempts)} attempt" + ("" if attempts == 1 else "s")]
            if retry_in is not None:
                tries.append(f"next in {duration(retry_in)}")
            failing.append(
                f"rank {r['rank']}: {count(waiting)} chunk{'' if waiting == 1 else 's'} waiting for the output"
                + (f" since {clock(since, now)}" if since is not None else "")
                + f" ({', '.join(tries)}): {printable(error)}"
            )
    return lost + failing


def clock(at: float, now: float) -> str:
    """12:03 on the day of `now`, 2024-03-04 12:03 on another (local time: the page's rule too)."""
    try:
        then, today = time.localtime(at), time.localtime(now)
    except (OverflowError, OSError, ValueError):  # a time no calendar of this platform reaches
        return "--:--"
    same_day = then[:3] == today[:3]
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", then)


def _forgotten(ranks: int | None) -> list[str]:
    """Ranks past `max_tracked_ranks`: the totals hold their counts, the per-rank numbers do not."""
    if not ranks:
        return []
    return [
        f"{count(ranks)} ranks forgotten past max_tracked_ranks: in the hit ratio, tokens and rates, "
        "not in documents done or below"
    ]


def job_line(job: dict[str, Any] | None) -> str:
    """Whether the job is finished: every rank it declared (`X-Total-Ranks`) with its last chunk published
    ("" from a proxy too old to say, or before any rank declared or finished anything; the page's rule too)."""
    if not job:
        return ""
    declared, finished = job.get("ranks_declared"), job["ranks_finished"]
    if job["finished"]:
        return f"job finished: {count(declared)} of {count(declared)} ranks"
    if declared is not None:
        return f"job running: {count(finished)} of {count(declared)} ranks finished"
    if finished:
        ranks = f"{count(finished)} rank{'' if finished == 1 else 's'}"
        return f"job: {ranks} finished, of a number it did not declare (X-Total-Ranks): whether it is done is not known"
    return ""


def is_finished(r: Rank) -> bool:
    """The rank's last chunk is published (a proxy too old to say: its progress reached 1)."""
    finished = r.get("finished")
    return bool(finished) if finished is not None else r.get("progress") == 1


def _documents_done(ranks: list[Rank]) -> str:
    done = sum(r.get("done_documents") or 0 for r in ranks)
    declared = [r["total_documents"] for r in ranks if r.get("total_documents") is not None]
    if not ranks:
        return "no job yet"
    if len(declared) < len(ranks):
        on = f"{len(ranks)} rank" + ("s" if len(ranks) > 1 else "")
        return f"documents done {count(done)} on {on} (totals declared by {len(declared)})"
    total = sum(declared)
    unfinished: list[Any] = [r.get("eta_s") for r in ranks if not is_finished(r)]
    if not unfinished:
        eta = "finished"
    elif None in unfinished:
        eta = "ETA —"
    else:
        eta = "ETA " + duration(max(unfinished))
    finished = len(ranks) - len(unfinished)
    progress = percent(done / total if done < total else 1.0)  # inf / inf, of huge counts, is no ratio
    seen = f"{finished} of {len(ranks)} ranks seen finished"
    return f"documents done {count(done)} / {count(total)} ({progress}) · {eta} · {seen}"


def _rank_row(r: Rank) -> list[str]:
    done, total, ratio = r.get("done_documents"), r.get("total_documents"), r.get("progress")
    if done is None:
        progress = "nothing checkpointed yet"
    elif total is None:
        progress = f"{count(done)} done (no total declared)"
    else:
        filled = math.floor(min(ratio or 0.0, 1.0) * BAR_WIDTH)
        bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
        progress = f"{bar} {count(done)} / {count(total)} · {percent(ratio)}"
    return [
        str(r["rank"]),
        progress,
        rate(r.get("documents_per_s")),
        "finished" if r.get("finished") else "done" if ratio == 1 else duration(r.get("eta_s")),
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


def main(
    url: str,
    *,
    api_key: str | None,
    once: bool,
    raw: bool,
    sort: str,
    timeout_s: float = TIMEOUT_S,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    try:  # what no try can help, said before any
        stats_url(url)
        check_api_key(api_key)
    except ValueError as exc:
        print(f"inferproxy status: {printable(str(exc))}", file=sys.stderr)
        return 2
    if not (once or raw) and out.isatty():
        # Ctrl-C is how one stops watching: quietly. A handler of our own, which raises wherever it lands:
        # under asyncio.run's, one landing as a fetch's task has just ended was taken for nothing.
        previous = signal.signal(signal.SIGINT, _interrupted)
        try:
            return watch(url, api_key, sort, out, timeout_s)
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        finally:
            signal.signal(signal.SIGINT, previous)
    try:
        stats = decode(fetch(url, api_key, timeout_s), shown_url(url))
    except StatusError as exc:
        print(f"inferproxy status: {printable(str(exc))}", file=sys.stderr)
        return 1
    # --json: the object as it came, with anything but ASCII escaped (no byte of it can act on a terminal).
    text = json.dumps(stats, separators=(",", ":")) if raw else "\n".join(render(stats, shown_url(url), sort=sort))
    print(text, file=out)
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def watch(url: str, api_key: str | None, sort: str, out: TextIO, timeout_s: float = TIMEOUT_S) -> int:
    """Redraw every `REFRESH_S`; while the proxy does not answer, say so above its last numbers."""
    last: list[str] = []
    last_at = 0.0
    where = shown_url(url)
    while True:
        columns, lines = shutil.get_terminal_size()
        try:
            frame = last = render(decode(fetch(url, api_key, timeout_s), where), where, sort=sort, height=lines - 2)
            last_at = time.monotonic()
        except StatusError as exc:
            if exc.final:
                print(f"inferproxy status: {printable(str(exc))}", file=sys.stderr)
                return 1
            since = f" (numbers from {duration(time.monotonic() - last_at)} ago)" if last else ""
            frame = [f"disconnected, retrying every {REFRESH_S:g} s: {printable(str(exc))}{since}", *last]
        out.write(CLEAR + "\n".join(line[:columns] for line in frame[: lines - 1]) + "\n")
        out.flush()
        time.sleep(REFRESH_S)
