"""All of inferproxy's settings, in one pydantic-settings class.

Precedence: command-line flag > `INFERPROXY_<NAME>` environment variable >
TOML file (`--config`, else `INFERPROXY_CONFIG`; keys as the field names) > default. Lists read from
the environment take JSON or commas: `INFERPROXY_UPSTREAM=http://a:8000,http://b:8000`.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("inferproxy_config_file", default=None)

MiB = 1024 * 1024

CONFIG_ENV = "INFERPROXY_CONFIG"


def config_file_path(flag: Path | None) -> Path | None:
    """The TOML file to read: `--config`, else `INFERPROXY_CONFIG`, else none."""
    if flag is not None:
        return flag
    from_env = os.environ.get(CONFIG_ENV)
    return Path(from_env) if from_env else None


def describe_toml_error(path: Path, exc: tomllib.TOMLDecodeError) -> str:
    """`FILE: line L, column C: what is wrong`, the way compilers name a place in a file."""
    message = str(exc)
    found = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", message)
    if found is None:
        return f"{path}: {message}"
    return f"{path}: line {found[2]}, column {found[3]}: {found[1]}"


def config_file_keys(path: Path | None) -> set[str]:
    """The top-level keys of a config file (none if there is no file or it does not parse)."""
    if path is None:
        return set()
    try:
        return set(tomllib.loads(path.read_text()))
    except (OSError, ValueError):
        return set()


def unknown_setting(key: str) -> str:
    """What to say of a config file's key that is no setting: the one it is likely a misspelling of, else
    where the settings are listed. A flag's or a variable's spelling of a setting is taken for it."""
    names = list(Settings.model_fields)
    spelt = key.strip().lower().replace("-", "_").removeprefix("inferproxy_")
    close = [spelt] if spelt in names else difflib.get_close_matches(spelt, names, n=1)
    if close:
        return f"unknown setting {key!r} (did you mean {close[0]!r}?)"
    return (
        f"unknown setting {key!r}: the settings are listed in the README's Configuration table "
        f"(and in configs/inferproxy.toml, with their defaults)"
    )


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each `INFERPROXY_` variable of `environ` that is no setting (a misspelt one is otherwise
    ignored without a word): the setting it likely means, else where they are listed."""
    known = {f"INFERPROXY_{name.upper()}" for name in Settings.model_fields} | {CONFIG_ENV}
    names = sorted(name for name in environ if name.upper().startswith("INFERPROXY_") and name.upper() not in known)
    lines = []
    for name in names:
        # compared without the prefix, which every name shares and would make any two look alike
        close = difflib.get_close_matches(name[len("INFERPROXY_") :].lower(), list(Settings.model_fields), n=1)
        if close:
            lines.append(f"{name} is no setting, and is ignored: did you mean INFERPROXY_{close[0].upper()}?")
        else:
            lines.append(f"{name} is no setting, and is ignored: the settings are in the README's Configuration table")
    return lines


class Settings(BaseSettings):
    """Every setting of `inferproxy serve`; each line of the README's configuration table is one field."""

    model_config = SettingsConfigDict(env_prefix="INFERPROXY_", extra="forbid", validate_default=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on")
    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="upstream server root(s), e.g. http://127.0.0.1:8000; several mean replicas",
    )
    checkpoints_dir: Path = Field(Path("inferproxy-data/checkpoints"), description="request caches and checkpoints")
    output: str = Field("inferproxy-data/output", description="where published chunks go (a path or fsspec URL)")
    output_filename: str = Field(
        "${rank}_chunk_${chunk_index}.jsonl", description="name of a published chunk; .gz/.zst endings compress"
    )
    records_per_chunk: int = Field(6000, gt=0, description="documents per chunk")
    api_key: str | None = Field(None, description="clients must send `Authorization: Bearer KEY`")
    upstream_api_key: str | None = Field(None, description="sent upstream as `Authorization: Bearer KEY`")
    cache_error_statuses: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [400], description="error statuses cached and replayed like answers"
    )
    upstream_retries: int = Field(3, ge=0, le=20, description="retries on connection errors and 429/502/503/504")
    retry_backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles each retry, with jitter")
    batch_retries: int = Field(
        8,
        ge=0,
        le=50,
        description="a batch line's tries after upstream_retries, on 429, 5xx, timeouts and lost connections "
        "(backoff from retry_backoff_s, doubling, at most 30 s) before it goes to the error file",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="upstream connect timeout")
    read_timeout_s: float = Field(900.0, gt=0, description="upstream silence allowed mid-answer (long generations)")
    max_body_bytes: int = Field(32 * MiB, gt=0, description="larger request bodies get 413")
    # An upload is streamed to disk as it arrives, never held in memory: this bounds the disk, not the RAM.
    # OpenAI's own limit for a file (its Batch API takes 200 MB of them).
    max_file_bytes: int = Field(
        512 * MiB, gt=0, description="a larger upload to POST /v1/files gets 413 and nothing of it is kept"
    )
    # An answer is held whole in memory to be stored (and a cached one is replayed whole): this bounds
    # what one upstream answer can make the proxy hold. Far above an LLM answer, logprobs or a batch of
    # embeddings included; well below SQLite's 1 GB limit on a stored value.
    max_response_bytes: int = Field(
        256 * MiB,
        gt=0,
        description="a larger upstream answer gets 502 (a streamed one is passed on but not stored)",
    )
    flush_interval_ms: float = Field(50.0, gt=0, description="cache group-commit window: the most a crash loses")
    fsync: Literal["always", "never"] = Field("always", description="checkpoint durability policy")
    health_interval_s: float = Field(5.0, gt=0, description="how often an unhealthy replica is probed")
    shutdown_grace_s: float = Field(30.0, ge=0, description="time in-flight requests get to finish on SIGTERM")
    head_timeout_s: float = Field(
        30.0, gt=0, description="a request's line and headers must arrive within this (else 408; built-in server)"
    )
    body_timeout_s: float = Field(
        300.0, gt=0, description="a request's body must arrive within this (else 408; built-in server)"
    )
    max_connections: int | None = Field(
        None,
        gt=0,
        description="client connections open at once; past it a new one gets 503 "
        "(default: what the open files limit leaves, see the README)",
    )
    max_inflight_per_upstream: int = Field(
        512,
        ge=0,
        description="requests in flight per upstream replica (0: no limit); more wait in a queue",
    )
    routing: Literal["affinity", "least-inflight"] = Field(
        "affinity",
        description="how a replica is chosen: by X-Doc-Id (else the prompt's opening), so that a document's "
        "rollouts meet in one replica's prefix cache; or the least busy one",
    )
    # 0.5: a replica holds at most half again its share of the requests in flight. Rollouts come in lumps
    # (a document's 4 at once), and at a few dozen documents in flight hashing alone often leaves a replica
    # a quarter over its share: at 0.25 a tenth of the documents had a rollout spilled at 64 in flight (2
    # replicas, bench/sim_load_bound.py), under 1% at 0.5; on real vLLM, whose requests end in bursts, 0.5
    # still spills 13-18% (bench/README.md, bench_routing.py). Far above it, a hot document or a slow
    # replica piles up; with 2 replicas, 1 never binds.
    affinity_load_bound: float = Field(
        0.5,
        gt=0,
        le=100,
        description="under affinity, a replica over (1 + this) x the mean requests in flight passes a "
        "request on to the document's next replica",
    )
    max_queued_requests: int = Field(
        4096,
        ge=0,
        description="requests waiting for an upstream slot; past it, 429 with Retry-After at once",
    )
    rank_idle_s: float = Field(
        60.0, ge=0, description="a rank unused this long is released for another proxy to take over (0: never)"
    )
    max_waiting_chunks: int = Field(
        8,
        gt=0,
        description="complete chunks of a rank waiting for the output (slow or away); past it new documents get 503",
    )
    backlog_wait_s: float = Field(
        10.0,
        ge=0,
        description="past max_waiting_chunks on an output that works, how long a write waits for it before 503",
    )
    publish_retry_max_s: float = Field(
        60.0, gt=0, description="longest wait between two tries of a publication that failed (backoff from 1 s)"
    )
    max_open_ranks: int = Field(
        256,
        gt=0,
        description="ranks kept open at once (each holds ~5-7 files); past it the least recently used idle one closes",
    )
    max_tracked_ranks: int = Field(
        1024,
        gt=0,
        description="ranks whose counts /stats and /metrics show one by one; past it the least recently "
        "active ones not open are added up as `forgotten`",
    )
    http: Literal["builtin", "uvicorn"] = Field(
        "builtin", description="HTTP server: the built-in one (cache hits on its fast path) or uvicorn"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text, or one JSON object each")
    log_hits_every: int = Field(
        100,
        ge=0,
        description="one request line at INFO per this many cache hits (1: every hit, 0: none), "
        "so that a replay storm does not flood the log; every other request gets its line",
    )
    metrics: bool = Field(
        True, description="count cache hits for /metrics and /stats (off only to measure what counting costs)"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case_level(cls, value: Any) -> Any:
        # `DEBUG` is how Python and most tools spell a level: take it as written.
        return value.lower() if isinstance(value, str) else value

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("cache_error_statuses", mode="before")
    @classmethod
    def _split_statuses(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("upstream")
    @classmethod
    def _normalise_upstreams(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one upstream is needed, e.g. http://127.0.0.1:8000")
        roots: list[str] = []
        servers: dict[tuple[str, str, int, str], str] = {}  # the server each root names, credentials aside
        for url in value:
            root = url.strip().rstrip("/").removesuffix("/v1")
            try:
                parts = urlsplit(root)
                parts.port  # noqa: B018 - raises ValueError for a port that is not a number
            except ValueError:
                parts = None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"an upstream is an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
            server = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), parts.path)
            if server in servers:  # as two replicas, it would take twice the requests of each other one
                raise ValueError(f"the upstream {servers[server]} is given twice (as {url!r}): give each replica once")
            servers[server] = root
            roots.append(root)
        return roots

    @field_validator("checkpoints_dir", mode="before")
    @classmethod
    def _local_checkpoints(cls, value: Any) -> Any:
        # Checkpoints need flock, rename and SQLite: a URL would become a local folder named `s3:`.
        if "://" in str(value):
            raise ValueError("the checkpoints dir is a local path (a shared filesystem works), not a URL")
        return value

    @field_validator("api_key", "upstream_api_key")
    @classmethod
    def _header_safe_key(cls, value: str | None) -> str | None:
        # sent or compared as an HTTP header's value: a line break or other control character would be
        # refused at each request (a client's key could never match), so it is refused here, once
        if value is not None and not header_safe_key(value):
            raise ValueError("a key is a line of text, without control characters (a line break?)")
        return value or None  # an empty one (INFERPROXY_API_KEY=) is none, as it always was

    @field_validator("output_filename")
    @classmethod
    def _safe_output_filename(cls, value: str) -> str:
        from app.checkpoints.publish import check_output_filename

        check_output_filename(value)
        return value

    @field_validator("cache_error_statuses")
    @classmethod
    def _cacheable_errors_only(cls, value: list[int]) -> list[int]:
        never = {401, 403, 404, 408, 409, 429}
        for status in value:
            if not 400 <= status <= 499 or status in never:
                raise ValueError(
                    f"cache_error_statuses may hold 4xx statuses other than {sorted(never)} "
                    f"(they depend on time or credentials, not on the request), got {status}"
                )
        return sorted(set(value))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        config_file = _CONFIG_FILE.get()
        if config_file is not None:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=config_file),)
        return sources

    @classmethod
    def load(cls, config_file: Path | None = None, **flags: Any) -> Settings:
        """Settings from flags (those not None), the environment, the TOML file and defaults.

        The file is `config_file`, else the one `INFERPROXY_CONFIG` names. A file that does not
        exist or does not parse raises FileNotFoundError or ValueError naming it.
        """
        given = config_file
        config_file = config_file_path(config_file)
        source = f" (from {CONFIG_ENV})" if given is None else ""
        if config_file is not None:
            check_config_file(config_file, source)
        token = _CONFIG_FILE.set(config_file)
        try:
            return cls(**{name: value for name, value in flags.items() if value is not None})
        except tomllib.TOMLDecodeError as exc:
            assert config_file is not None  # only the file is TOML
            raise ValueError(describe_toml_error(config_file, exc)) from None
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"config file {config_file}{source} is not UTF-8 text (byte {exc.start}): save it as UTF-8 TOML"
            ) from None
        finally:
            _CONFIG_FILE.reset(token)


def header_safe_key(key: str) -> bool:
    """Whether an `Authorization: Bearer KEY` header can carry `key`: no control character (a line break, NUL)."""
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in key)


def check_config_file(path: Path, source: str = "") -> None:
    """`FileNotFoundError` or `ValueError`, in one line, for a config file that is not a readable regular
    file; never opens one that is not (a FIFO would block the open)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path}{source} does not exist") from None
    except OSError as exc:
        raise ValueError(f"config file {path}{source} cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise FileNotFoundError(f"config file {path}{source} is a folder: give the TOML file in it")
    if not stat.S_ISREG(mode):
        raise ValueError(f"config file {path}{source} is not a regular file: give a TOML file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ValueError(f"config file {path}{source} cannot be read: {exc.strerror}") from None


def _split(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):  # repeated flags: each may itself be a comma list or JSON
        return [item for part in value for item in (_split(part) if isinstance(part, str) else [part])]
    return value
