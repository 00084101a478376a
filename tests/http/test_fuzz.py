"""Differential fuzzing of app.http against h11: the server's requests and the client's answers.

Hypothesis draws byte streams (tests/http_fuzz.py); the server and the client must see in them
what h11, the reference HTTP/1.1 implementation, sees, wherever both accept them, must never
crash, and must never hand an app a request after they refused or closed.

Where they part ways on purpose, `LENIENCIES` says why (llhttp takes some things h11 refuses,
and refuses some it takes). Where they part ways by a bug still open, `KNOWN_DIVERGENCES` names
it, so that the suite stays green until its fix lands: delete the entry with the fix.

The run: `HYPOTHESIS_PROFILE=ci` (the default: fixed seed, ~250 examples per test, a few
seconds) or `long` (`FUZZ_EXAMPLES`, default 20,000); `make fuzz` runs bench/fuzz_http.py,
which collects every divergence instead of stopping at the first.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings

from tests.http_fuzz import (
    Finding,
    Part,
    compare_client,
    compare_server,
    h11_client,
    h11_server,
    request_streams,
    response_streams,
    run_client,
    run_server,
)

# (kind, tag) -> why ours may differ from h11 there, for good. Kinds: see `Finding`; tags:
# the generated part's mutation (tests/http_fuzz.py MUTATIONS) and its notable valid features.
LENIENCIES: dict[tuple[str, str], str] = {
    # The server: llhttp refuses what h11 takes; each refusal is allowed by RFC 9110/9112, and safer.
    ("strict", "bare-lf"): "RFC 9112 §2.2: a recipient MAY take a bare LF as a line end; llhttp does not",
    ("strict", "obs-fold"): "RFC 9112 §5.2: a server MAY reject obs-fold with 400; llhttp does",
    ("strict", "ctl"): "RFC 9110 §5.5: CTLs are invalid in a field value; h11 lets them through",
    ("strict", "del"): "RFC 9110 §5.5: DEL is invalid in a field value; h11 lets it through",
    ("strict", "cl-dup"): "RFC 9112 §6.3: repeated Content-Length MAY be refused; llhttp does",
    ("strict", "cl-list"): "RFC 9112 §6.3: a Content-Length list MAY be refused; llhttp does",
    ("strict", "te-and-cl"): "RFC 9112 §6.1: Transfer-Encoding with Content-Length MAY be refused; safer",
    ("strict", "method-case"): "methods are case-sensitive (RFC 9110 §9.1); llhttp knows only registered ones",
    ("strict", "method-unknown"): "llhttp knows only registered methods; the proxy needs none of the others",
    ("strict", "version-odd"): "llhttp refuses versions other than 1.0/1.1, as the proxy speaks no other",
    ("closed", "version-odd"): "llhttp does not keep HTTP/2.0 connections alive; h11 takes them as 1.1",
    ("keep-alive", "version-odd"): "llhttp keeps HTTP/0.9 with `Connection: keep-alive` alive, as HTTP/1.0",
    ("strict", "target-asterisk"): "OPTIONS * means nothing to the proxy; refusing it is allowed (RFC 9110 §15.5.1)",
    ("strict", "target-authority"): "authority-form is for CONNECT only (RFC 9112 §3.2.3)",
    ("strict", "misaligned"): "a body swallowed the start of the next request: the rest is garbage to both",
    ("strict", "connect"): "issue 9: CONNECT is refused, by design",
    ("strict", "trace"): "issue 9: TRACE is refused, by design",
    ("strict", "upgrade-body"): "issue 9: an Upgrade request with a body is refused, by design",
    # The server: llhttp takes what h11 refuses; each harmless to framing.
    ("lenient", "leading-crlf"): "RFC 9112 §2.2: a server SHOULD ignore an empty line before a request line",
    ("lenient", "misaligned"): "what a mis-sized body left (a stray LF, say) is skipped as an empty line (§2.2)",
    ("lenient", "no-host"): "RFC 9112 §3.2 wants 400; nothing here routes on Host (uvicorn takes it too)",
    ("lenient", "host-dup"): "RFC 9112 §3.2 wants 400; nothing here routes on Host (uvicorn takes it too)",
    ("lenient", "chunk-ext-ws"): "RFC 9112 §7.1.1 allows BWS before ';' in a chunk extension; h11 refuses it",
    ("lenient", "te-gzip-chunked"): "framed by the final chunked (RFC 9112 §6.3), sound; the coding is left to the app",
    ("lenient", "te-multi"): "framed by the final chunked (RFC 9112 §6.3), sound; the coding is left to the app",
    ("keep-alive", "http10"): "h11 never keeps an HTTP/1.0 connection alive; llhttp honours Connection: keep-alive",
    # The client: the same llhttp choices on answers.
    ("client-strict", "cl-dup"): "RFC 9112 §6.3: repeated Content-Length MAY be refused; llhttp does",
    ("client-strict", "cl-list"): "RFC 9112 §6.3: a Content-Length list MAY be refused; llhttp does",
    ("client-strict", "ctl"): "RFC 9110 §5.5: CTLs are invalid in a field value; h11 lets them through",
    ("client-strict", "del"): "RFC 9110 §5.5: DEL is invalid in a field value; h11 lets it through",
    ("client-strict", "obs-fold"): "RFC 9112 §5.2: obs-fold MAY be refused (as a 502); llhttp does",
    ("client-strict", "te-and-cl"): "RFC 9112 §6.1: Transfer-Encoding with Content-Length MAY be refused; safer",
    ("client-lenient", "te-gzip-chunked"): "framed by the final chunked, sound; the coding is left to the caller",
    ("client-lenient", "te-multi"): "framed by the final chunked, sound; the coding is left to the caller",
    ("client-lenient", "te-double"): "framed by the final chunked, sound; h11 refuses chunked applied twice",
    ("client-lenient", "te-identity"): "RFC 9112 §6.3: an answer whose coding is not chunked ends at the close",
    ("client-lenient", "te-invalid"): "RFC 9112 §6.3: an answer whose coding is not chunked ends at the close",
    ("client-lenient", "te-chunked-not-last"): "RFC 9112 §6.3: an answer not ending in chunked ends at the close",
    ("lenient", "te-identity"): "RFC 9112 §6.3 wants 400 at the head; llhttp gives it at the first body byte, "
    "and no app acts before the body is whole",
    ("lenient", "te-chunked-not-last"): "as te-identity: refused at the first body byte, before any app acts",
    ("lenient", "te-invalid"): "as te-identity: refused at the first body byte, before any app acts",
    ("strict", "trailers"): "a trailer field named Content-Length is refused by llhttp: a framing field must not "
    "be a trailer (RFC 9110 §6.5.1), so refusing it is safe",
    ("client-strict", "trailers"): "as the server's: a Content-Length trailer fails the answer (a 502), safely",
    ("client-strict", "status-odd"): "issue 9: a status outside 100-599 is refused (a 502), by design",
    ("client-strict", "status-101"): "issue 9: a 101 would take the connection over: refused (a 502), by design",
    ("client-lenient", "status-no-body"): "a 204/304 has no body whatever its Transfer-Encoding says (RFC 9112 §6.3)",
}

# (kind, tag) -> a bug still open: delete the entry when its fix lands.
KNOWN_DIVERGENCES: dict[tuple[str, str], str] = {}

settings.register_profile(
    "ci",
    max_examples=1000,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "20000")),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def excuse(finding: Finding) -> str | None:
    """Why `finding` is allowed (a leniency or a known open bug), or None: it is a failure.

    Looked up by (kind, tag) for each of the part's tags (its mutation is one).
    """
    for key in sorted(finding.part.tags):
        reason = LENIENCIES.get((finding.kind, key)) or KNOWN_DIVERGENCES.get((finding.kind, key))
        if reason:
            return reason
    return None


def unexcused(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if excuse(f) is None]


def server_findings(parts: list[Part], pieces: list[bytes]) -> list[Finding]:
    data = b"".join(pieces)
    return compare_server(parts, run_server(pieces), h11_server(data))


def client_findings(method: bytes, parts: list[Part], pieces: list[bytes]) -> list[Finding]:
    data = b"".join(pieces)
    return compare_client(parts, run_client(method, pieces), h11_client(method, data))


@settings(PROFILE)
@given(request_streams())
def test_server_sees_the_requests_h11_sees_and_nothing_it_refused(stream: tuple[list[Part], list[bytes]]) -> None:
    parts, pieces = stream
    assert unexcused(server_findings(parts, pieces)) == []


@settings(PROFILE)
@given(response_streams())
def test_client_reads_the_answers_h11_reads_and_never_a_short_body(
    stream: tuple[bytes, list[Part], list[bytes]],
) -> None:
    method, parts, pieces = stream
    assert unexcused(client_findings(method, parts, pieces)) == []
