"""A local S3 server for the object-storage tests: moto's, behind a recorder.

    python -m tests.s3_server PORT

moto (in server mode) keeps buckets and objects in memory and answers the S3
API as AWS does. In front of it, a WSGI layer records every request (method,
path, query) so a test can count the PUTs each key received and see that no
multipart upload was started, and it can hold object PUTs before moto reads
their body, so that a test can kill the uploader with its upload in flight,
or refuse them as S3 refuses a request its credentials do not allow:

    GET  /_test/requests   every S3 request so far: [{"method", "path", "query", "status"}]
    POST /_test/hold       from now on, object PUTs wait (before their body is read)
    POST /_test/release    let the waiting PUTs (and later ones) through
    POST /_test/deny       from now on, object PUTs get 403 AccessDenied (S3's XML error; nothing stored)
    POST /_test/allow      object PUTs go to moto again

Bucket names cannot start with `_`, so `/_test/` never shadows one.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple

StartResponse = Callable[..., Any]

ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
    b"<RequestId>TESTDENIED0000</RequestId><HostId>test</HostId></Error>"
)


class Recorder:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.open.set()
        self.denied = threading.Event()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if path.startswith("/_test/"):
            return self.control(method, path, start_response)
        entry: dict[str, Any] = {"method": method, "path": path, "query": environ.get("QUERY_STRING", "")}
        entry["held"] = method == "PUT" and not self.open.is_set()
        with self.lock:
            self.requests.append(entry)
        if method == "PUT":
            self.open.wait()  # only uploads are held: listings and reads go on
        if method == "PUT" and self.denied.is_set() and path.strip("/").count("/") >= 1:  # an object's, not a bucket's
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length)  # read, so that the connection can be used again
            entry["status"] = 403
            start_response(
                "403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(ACCESS_DENIED)))]
            )
            return [ACCESS_DENIED]

        def recording_start_response(status: str, headers: Any, *args: Any) -> Any:
            entry["status"] = int(status.split()[0])
            return start_response(status, headers, *args)

        try:
            return self.app(environ, recording_start_response)  # type: ignore[no-any-return]
        except Exception as exc:  # a client gone mid-body: S3 stores nothing of such a request
            entry["status"] = 400
            entry["error"] = f"{type(exc).__name__}: {exc}"
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"IncompleteBody"]

    def control(self, method: str, path: str, start_response: StartResponse) -> Iterable[bytes]:
        if method == "GET" and path == "/_test/requests":
            with self.lock:
                body = orjson.dumps(self.requests)
        elif method == "POST" and path == "/_test/hold":
            self.open.clear()
            body = b"{}"
        elif method == "POST" and path == "/_test/release":
            self.open.set()
            body = b"{}"
        elif method == "POST" and path == "/_test/deny":
            self.denied.set()
            body = b"{}"
        elif method == "POST" and path == "/_test/allow":
            self.denied.clear()
            body = b"{}"
        else:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"unknown test route"]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]


def main(port: int) -> None:
    app = Recorder(DomainDispatcherApplication(create_backend_app))
    run_simple("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(int(sys.argv[1]))
