"""Where `/v1/files` follows OpenAI's Files API beyond the basics (tests/service/test_files.py): a file's
`expires_after`, told by a clock the test moves; HEAD on a file and its content; the list's cursor pages as
the `openai` package follows them. The real `openai` client against a proxy on a loopback port, under both
HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from app.service.app import create_app
from app.service.settings import Settings
from app.store.files import FileStore
from tests.servers import fake_upstream, serve_proxy
from tests.service.test_batches import CHAT, chat_line, final, until
from tests.service.test_checkpoint_routes import config
from tests.service.test_files import KEY, PURPOSE, form, kept, one_line_error, sdk, upload

pytestmark = pytest.mark.usefixtures("http_server")

HOUR = 3600
EXPIRES = {"anchor": "created_at", "seconds": HOUR}
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Clock:
    """The time the proxy's file store tells expiry by: now, until the test moves it."""

    now: float = field(default_factory=time.time)

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def proxy(tmp_path: Path, clock: Clock) -> AsyncIterator[str]:
    async with fake_upstream() as (url, _), served(config(tmp_path, url, api_key=KEY), clock) as proxied:
        yield proxied


def served(settings: Settings, clock: Clock) -> contextlib.AbstractAsyncContextManager[str]:
    return serve_proxy(settings, create_app(settings, clock=clock))


def gone(client: openai.OpenAI, file_id: str) -> None:
    """The file answers 404 as a missing one does, on every route, and is not listed."""
    for route in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError, match=f"No such File object: {file_id}"):
            route(file_id)
    assert file_id not in [f.id for f in client.files.list()]


# -- expires_after ------------------------------------------------------------------------------


async def test_a_file_with_expires_after_is_gone_once_it_expires_and_its_bytes_with_it(
    proxy: str, tmp_path: Path, clock: Clock
) -> None:
    def scenario() -> str:
        client = sdk(proxy)
        expiring = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=EXPIRES)
        clock.now += 1
        kept_file = client.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert expiring.expires_at == expiring.created_at + HOUR
        assert kept_file.expires_at is None
        assert client.files.retrieve(expiring.id) == expiring
        assert [f.id for f in client.files.list()] == [kept_file.id, expiring.id]

        clock.now = expiring.created_at + HOUR - 1  # a second before: still there
        assert client.files.content(expiring.id).content == b"{}\n"
        clock.now = expiring.created_at + HOUR
        gone(client, expiring.id)
        assert client.files.retrieve(kept_file.id) == kept_file
        return kept_file.id

    other = await asyncio.to_thread(scenario)
    assert kept(tmp_path) == sorted([other, other + ".json"]), "the expired file's bytes are still on disk"


async def test_a_restart_removes_the_files_that_expired_while_it_was_down(tmp_path: Path, clock: Clock) -> None:
    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url, api_key=KEY)
        async with served(settings, clock) as proxy:
            made = await asyncio.to_thread(
                lambda: sdk(proxy).files.create(file=("a.jsonl", b"{}\n"), purpose="batch", expires_after=EXPIRES)
            )
        assert len(kept(tmp_path)) == 2
        clock.now += HOUR
        async with served(settings, clock):  # no request asks for it: the start's sweep removes it
            for _ in range(1000):
                if not kept(tmp_path):
                    break
                await asyncio.sleep(0.01)
        assert kept(tmp_path) == [], f"{made.id} expired, and its bytes are still there"


async def test_a_running_batchs_input_that_expires_is_gone_from_the_api_but_read_to_the_end(
    tmp_path: Path, clock: Clock
) -> None:
    async with fake_upstream(latency_ms=100) as (url, fake):
        settings = config(tmp_path, url, api_key=KEY, max_inflight_per_upstream=1)
        async with served(settings, clock) as proxy:
            lines = b"".join(orjson.dumps(chat_line(f"r{i}", f"q{i}")) + b"\n" for i in range(60))
            client = sdk(proxy)
            made = await asyncio.to_thread(
                client.files.create, file=("in.jsonl", lines), purpose="batch", expires_after=EXPIRES
            )
            async with httpx.AsyncClient(base_url=proxy, headers=AUTH, timeout=30) as http:
                created = await http.post("/v1/batches", json={"input_file_id": made.id, "endpoint": CHAT})
                batch_id = created.json()["id"]
                await until(http, batch_id, lambda b: b["request_counts"]["completed"] >= 2)
                clock.now += HOUR
                await asyncio.to_thread(gone, client, made.id)  # DELETE too: 404, not the 409 of a running input
                assert made.id in kept(tmp_path), "the input was removed under the batch reading it"
                running = (await http.get(f"/v1/batches/{batch_id}")).json()
                assert running["status"] == "in_progress", "the batch ended before the file expired: slow it"
                refused = await http.post("/v1/batches", json={"input_file_id": made.id, "endpoint": CHAT})
                assert "no file" in one_line_error(refused, 400)

                await http.post(f"/v1/batches/{batch_id}/cancel")
                done = await until(http, batch_id, final)
                assert done["status"] == "cancelled"
                assert done["request_counts"]["completed"] >= 2
                await asyncio.to_thread(gone, client, made.id)  # the batch reads it no more: its bytes go now
                assert made.id not in kept(tmp_path)
                assert made.id + ".json" not in kept(tmp_path)
        assert fake.requests >= 2


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"expires_after[anchor]": "updated_at", "expires_after[seconds]": "3600"}, "anchor", "must be created_at"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "seconds", "3600 (1 hour)"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "seconds", "2592000 (30"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"}, "seconds", "an integer from"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-3600"}, "seconds", "an integer from"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000}, "seconds", "an integer"),
        ({"expires_after[anchor]": "created_at"}, "seconds", "the form has no expires_after[seconds]"),
        ({"expires_after[seconds]": "3600"}, "anchor", "the form has no expires_after[anchor]"),
    ],
)
async def test_a_bad_expires_after_is_a_400_naming_the_field_and_nothing_is_kept(
    proxy: str, tmp_path: Path, fields: dict[str, str], param: str, says: str
) -> None:
    parts = [PURPOSE, ("file", "a.jsonl", b"{}\n"), *((name, None, value.encode()) for name, value in fields.items())]
    answer = await upload(proxy, form(*parts))
    assert says in one_line_error(answer, 400)
    assert answer.json()["error"]["param"] == f"expires_after[{param}]"
    assert kept(tmp_path) == []


async def test_the_openai_client_is_told_what_expires_after_allows(proxy: str, tmp_path: Path) -> None:
    def refused() -> None:
        with pytest.raises(openai.BadRequestError, match=r"expires_after\[seconds\] must be an integer from 3600"):
            sdk(proxy).files.create(
                file=("a.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
            )

    await asyncio.to_thread(refused)
    assert kept(tmp_path) == []


# -- HEAD -----------------------------------------------------------------------------------------


async def test_head_on_a_file_and_its_content_answers_as_get_without_a_body(proxy: str) -> None:
    made = await asyncio.to_thread(lambda: sdk(proxy).files.create(file=("a b.jsonl", b"x" * 3000), purpose="batch"))
    async with httpx.AsyncClient(base_url=proxy, headers=AUTH, timeout=30) as client:
        for path in (f"/v1/files/{made.id}", f"/v1/files/{made.id}/content"):
            got = await client.get(path)
            head = await client.head(path)
            assert head.status_code == got.status_code == 200, path
            assert head.content == b""
            for name in ("content-type", "content-length", "content-disposition"):
                assert head.headers.get(name) == got.headers.get(name), (path, name)
            assert int(head.headers["content-length"]) == len(got.content)
        missing = await client.head("/v1/files/file-000000000000000000000000/content")
        assert (missing.status_code, missing.content) == (404, b"")
        assert (await client.get(f"/v1/files/{made.id}")).json()["id"] == made.id  # the connection goes on


# -- the list's pages -------------------------------------------------------------------------------


async def test_the_openai_client_pages_through_a_list_larger_than_a_page(
    proxy: str, tmp_path: Path, clock: Clock
) -> None:
    store = FileStore(tmp_path / "ckpt" / "files", clock=clock)  # the batches' output files, beside the uploads
    outputs = []
    for _ in range(3):
        clock.now += 1  # each file a second after the one before: the order they are listed in
        with store.writing("out.jsonl", "batch_output") as writer:
            writer.write(b"{}\n")
        outputs.append(writer.id)

    def scenario() -> list[str]:
        client = sdk(proxy)
        uploads = []
        for i in range(23):
            clock.now += 1
            uploads.append(client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id)
        every = outputs + uploads  # in the order they were made
        assert [f.id for f in client.files.list(limit=5)] == every[::-1]
        assert [f.id for f in client.files.list(limit=5, order="asc")] == every
        assert [f.id for f in client.files.list(limit=4, purpose="batch")] == uploads[::-1]
        assert [f.id for f in client.files.list(limit=2, purpose="batch_output", order="asc")] == outputs
        first = client.files.list(limit=10)
        assert (len(first.data), first.has_more, first.has_next_page()) == (10, True, True)
        second = first.get_next_page()
        assert [f.id for f in second.data] == every[::-1][10:20]
        last = client.files.list(limit=6, after=every[::-1][19])
        assert ([f.id for f in last.data], last.has_more) == (every[::-1][20:], False)
        assert not last.has_next_page()
        return every

    every = await asyncio.to_thread(scenario)
    seen = []
    async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key=KEY, max_retries=0) as client:
        async for listed in client.files.list(limit=4, order="asc"):  # deleting each as it goes: the pages go on
            seen.append(listed.id)
            await client.files.delete(listed.id)
        assert seen == every
        assert (await client.files.list()).data == []
    assert kept(tmp_path) == []


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=10001", "limit"),
        ("limit=-1", "limit"),
        ("order=newest", "order"),
        ("after=file-nope", "after"),
    ],
)
async def test_a_bad_list_parameter_is_a_400_naming_it(proxy: str, query: str, param: str) -> None:
    async with httpx.AsyncClient(base_url=proxy, headers=AUTH) as client:
        answer = await client.get(f"/v1/files?{query}")
        one_line_error(answer, 400)
        assert answer.json()["error"]["param"] == param
