"""`/openapi.json` and `/docs`: every control route described with its models, the real answers of a
job matching those models, both open without the key while the routes they describe keep needing it,
and the docs page rendered in headless Chromium from the proxy's own files (no CDN: GPU clusters are
often offline)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from app.service import api, models
from tests.browser import Browser
from tests.factories import chat_request, doc_headers
from tests.servers import fake_upstream, proxy_client, serve_proxy
from tests.service.test_checkpoint_routes import config, doc

pytestmark = pytest.mark.usefixtures("http_server")

#: The control plane, as docs/contract.md's route table lists it: (method, path) -> its answer's model.
CONTROL = {
    ("post", "/documents"): "DocumentsWritten",
    ("post", "/chunks/{i}/complete"): "ChunkCompleted",
    ("get", "/resume"): "ResumePoint",
    ("post", "/lookup"): "LookedUp",
    ("post", "/v1/files"): "FileObject",
    ("get", "/v1/files"): "FileList",
    ("get", "/v1/files/{file_id}"): "FileObject",
    ("delete", "/v1/files/{file_id}"): "FileDeleted",
    ("get", "/healthz"): "Health",
    ("get", "/readyz"): "Ready",
    ("get", "/stats"): "Stats",
    ("post", "/v1/batches"): "Batch",
    ("get", "/v1/batches"): "BatchList",
    ("get", "/v1/batches/{batch_id}"): "Batch",
    ("post", "/v1/batches/{batch_id}/cancel"): "Batch",
}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as c:
        yield c


def answer_ref(operation: dict[str, Any]) -> str:
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    return str(schema["$ref"]).rsplit("/", 1)[-1]


async def test_the_schema_describes_every_control_route_with_its_models_and_of_v1_only_the_batch_api(
    client: httpx.AsyncClient,
) -> None:
    served = await client.get("/openapi.json")
    assert served.status_code == 200
    schema = served.json()
    assert schema["openapi"].startswith("3.1")
    described = {(method, path) for path, item in schema["paths"].items() for method in item}
    assert described == {*CONTROL, ("get", "/metrics"), ("get", "/"), ("get", "/v1/files/{file_id}/content")}
    components = schema["components"]["schemas"]
    for (method, path), model in CONTROL.items():
        operation = schema["paths"][path][method]
        assert answer_ref(operation) == model, (method, path)
        assert model in components
        assert operation["summary"], (method, path)
        if (method, path) not in {("get", "/healthz")}:  # every keyed route says so, and its 401
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            error = operation["responses"]["401"]["content"]["application/json"]["schema"]
            assert error["$ref"].endswith("/ErrorEnvelope")
    # the bodies the routes read themselves, and the headers they need
    for path, body in (("/documents", "Documents"), ("/lookup", "Lookups"), ("/v1/batches", "BatchCreate")):
        request = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert request["$ref"].endswith(f"/{body}")
        assert body in components
    headers = {p["name"]: p for p in schema["paths"]["/documents"]["post"]["parameters"]}
    assert headers["X-Chunk-Index"]["required"] is True
    assert {"X-Rank", "X-Total-Documents"} <= set(headers)
    assert "text/html" in schema["paths"]["/"]["get"]["responses"]["200"]["content"]
    # an upload's form, the listing's query, a file's bytes
    upload = schema["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["file", "purpose"]
    assert upload["properties"]["file"]["format"] == "binary"
    listed = {p["name"] for p in schema["paths"]["/v1/files"]["get"]["parameters"]}
    assert listed == {"purpose", "limit", "order", "after"}
    content = schema["paths"]["/v1/files/{file_id}/content"]["get"]
    assert "application/octet-stream" in content["responses"]["200"]["content"]
    assert content["security"] == [{"HTTPBearer": []}]
    assert {p["name"] for p in content["parameters"]} == {"file_id"}


async def test_a_jobs_real_answers_match_the_models_the_schema_names(client: httpx.AsyncClient) -> None:
    """`extra="forbid"` on the models: a field the proxy answers and the schema does not name fails here."""
    body = chat_request()
    assert (await client.post("/v1/chat/completions", json=body, headers=doc_headers("q"))).status_code == 200
    lookups = [{"doc_id": "q", "body": body}, {"doc_id": "z", "body": {}}]
    checks: list[tuple[type[BaseModel], httpx.Response]] = [
        (models.LookedUp, await client.post("/lookup", json=lookups)),  # before the rank finishes, and its cache
        (models.ResumePoint, await client.get("/resume", headers={"X-Total-Documents": "4"})),
        (models.DocumentsWritten, await client.post("/documents", json=[doc("a"), doc("b")], headers=chunk(0))),
        (models.DocumentsWritten, await client.post("/documents", json=doc("c"), headers=chunk(0))),  # full
        (models.DocumentsWritten, await client.post("/documents", json=doc("d"), headers=chunk(1))),
        (models.ChunkCompleted, await client.post("/chunks/1/complete")),
        (models.Health, await client.get("/healthz")),
        (models.Ready, await client.get("/readyz")),
        (models.Stats, await client.get("/stats")),
        (models.ResumePoint, await client.get("/resume")),
        (models.FileObject, uploaded := await client.post("/v1/files", files=UPLOAD, data={"purpose": "batch"})),
        (models.FileList, await client.get("/v1/files")),
        (models.FileObject, await client.get(f"/v1/files/{uploaded.json()['id']}")),
        (models.FileDeleted, await client.delete(f"/v1/files/{uploaded.json()['id']}")),
    ]
    for model, answer in checks:
        assert answer.status_code == 200, (answer.request.url, answer.text)
        model.model_validate(answer.json())
    looked_up = models.LookedUp.model_validate(checks[0][1].json()).root
    assert looked_up[0] is not None
    assert looked_up[1] is None
    # and an error, in the envelope the schema names for it
    refused = await client.post("/documents", json=doc("e"))  # no X-Chunk-Index
    assert refused.status_code == 400
    assert "X-Chunk-Index" in models.ErrorEnvelope.model_validate(refused.json()).error.message


UPLOAD = {"file": ("input.jsonl", b'{"custom_id": "a"}\n')}


def chunk(index: int) -> dict[str, str]:
    return {"X-Chunk-Index": str(index)}


async def test_the_schema_and_docs_are_open_without_the_key_and_what_they_describe_is_not(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url, api_key="sekrit")) as client:
        for path in (api.OPENAPI_URL, api.DOCS_URL, *(f"{api.DOCS_URL}/{name}" for name in api.DOCS_ASSETS)):
            served = await client.get(path)
            assert served.status_code == 200, path
        assets = {
            name: (await client.get(f"{api.DOCS_URL}/{name}")).headers["content-type"] for name in api.DOCS_ASSETS
        }
        assert assets == {
            name: kind if kind == "image/png" else f"{kind}; charset=utf-8" for name, kind in api.DOCS_ASSETS.items()
        }
        page = (await client.get(api.DOCS_URL)).text
        assert "http://" not in page  # nothing from a CDN, nothing from the web
        assert "https://" not in page
        for method, path in CONTROL:
            if path in ("/healthz",):
                continue
            concrete = path.replace("{i}", "0").replace("{file_id}", "file-0")
            refused = await client.request(method, concrete)
            assert refused.status_code == 401, (method, path)
        assert "inferproxy" in page  # the proxy's own docs page, not the upstream's


async def test_the_docs_page_renders_every_operation_offline_in_headless_chromium(
    chrome: Browser, tmp_path: Path
) -> None:
    async with fake_upstream() as (url, _), serve_proxy(config(tmp_path, url, api_key="sekrit")) as proxy:
        page = await chrome.open(proxy + api.DOCS_URL)
        operations = len(CONTROL) + 3  # /metrics, the page at / and a file's content
        await page.wait_for(f"document.querySelectorAll('.opblock').length === {operations}")
        title = await page.evaluate("document.querySelector('.info .title')?.textContent ?? ''")
        assert title.startswith("inferproxy")
        shown = await page.evaluate(
            "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.dataset.path ?? e.textContent)"
        )
        assert {path for _, path in CONTROL} <= {str(p).replace("\u200b", "") for p in shown}
        # the proxy served everything the page asked for: it works on a cluster without the internet
        assert page.requests
        assert all(request.startswith(proxy) for request in page.requests), page.requests
        assert page.errors == []

        # "Try it out" on /healthz, from the page itself (open: no key needed)
        await page.evaluate(
            "document.querySelector('#operations-default-healthz_healthz_get .opblock-summary-control').click()"
        )
        await page.wait_for("document.querySelector('.try-out__btn') !== null")
        await page.evaluate("document.querySelector('.try-out__btn').click()")
        await page.wait_for("document.querySelector('.execute') !== null")
        await page.evaluate("document.querySelector('.execute').click()")
        answered = await page.wait_for(
            "document.querySelector('.live-responses-table tbody .response-col_status')?.textContent.trim()"
        )
        assert answered == "200"
        assert page.errors == []
