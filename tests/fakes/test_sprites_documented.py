"""The Sprites fake answers as the Sprites docs say (shared/reference/sprites.md, with its
2026-12-01 correction), through the shapes an adapter depends on: list items, page sizes,
unknown names, exec env, network rules. If one of these drifts toward what an adapter
would like, the adapter's tests stop meaning anything.
"""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from sprites import AsyncSpritesClient

from testing.fakes.sprites import FakeSprites, running_fake
from testing.fakes.sprites.network import allows, closed

LABELS = ["relay-cluster=doc", "relay-run=run_doc"]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeSprites]:
    with running_fake() as server:
        yield server


@pytest.fixture
def api(fake: FakeSprites) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, headers={"Authorization": "Bearer t"}) as client:
        yield client
    for name in fake.ledger.alive():
        fake.call("delete", name)


def make(api: httpx.Client, name: str) -> None:
    answer = api.post("/v1/sprites", json={"name": name, "labels": LABELS})
    assert answer.status_code == 201 and answer.json()["name"] == name


def test_a_list_item_is_name_org_slug_and_updated_at_only(api: httpx.Client) -> None:
    make(api, "doc-one")
    page = api.get("/v1/sprites", params={"prefix": "doc-"}).json()
    assert page["sprites"] == [
        {
            "name": "doc-one",
            "org_slug": page["sprites"][0]["org_slug"],
            "updated_at": page["sprites"][0]["updated_at"],
        }
    ]
    assert set(page) == {"sprites", "has_more", "next_continuation_token"}
    # Labels and the creation time come from a get, one sprite at a time.
    info = api.get("/v1/sprites/doc-one").json()
    assert info["labels"] == LABELS and info["created_at"]


def test_pages_hold_1_to_50_sprites_and_continue_by_token(api: httpx.Client) -> None:
    for n in range(52):
        make(api, f"doc-page-{n:02d}")
    for size in ("0", "51", "100", "x", "-1"):
        answer = api.get("/v1/sprites", params={"max_results": size})
        assert answer.status_code == 400, size
    seen: list[str] = []
    params: dict[str, str] = {"prefix": "doc-page-", "max_results": "50"}
    while True:
        page = api.get("/v1/sprites", params=params).json()
        assert 1 <= len(page["sprites"]) <= 50
        seen += [item["name"] for item in page["sprites"]]
        if not page["has_more"]:
            break
        params["continuation_token"] = page["next_continuation_token"]
    assert seen == [f"doc-page-{n:02d}" for n in range(52)]
    assert api.get("/v1/sprites", params={"max_results": "1"}).status_code == 200


def test_unknown_names_are_404_and_nothing_but_delete_ends_a_sprite(api: httpx.Client) -> None:
    assert api.get("/v1/sprites/doc-none").status_code == 404
    assert api.delete("/v1/sprites/doc-none").status_code == 404
    rules = {"rules": [{"domain": "*", "action": "deny"}]}
    assert api.post("/v1/sprites/doc-none/policy/network", json=rules).status_code == 404
    make(api, "doc-kept")
    info = api.get("/v1/sprites/doc-kept").json()
    # No lifetime on Sprites: nothing in a sprite says when it would end by itself.
    assert not {key for key in info if any(word in key for word in ("ttl", "expire", "timeout"))}
    assert api.delete("/v1/sprites/doc-kept").status_code == 204
    assert api.delete("/v1/sprites/doc-kept").status_code == 404


async def test_an_execs_env_replaces_the_default_environment(
    fake: FakeSprites, api: httpx.Client
) -> None:
    make(api, "doc-env")
    client = AsyncSpritesClient("t", base_url=fake.url)
    try:
        sprite = client.sprite("doc-env")
        script = 'echo "HOME=$HOME X=$X"'
        with_env = await sprite.run("sh", "-c", script, env={"X": "1"}, capture_output=True)
        without = await sprite.run("sh", "-c", script, capture_output=True)
    finally:
        await client.aclose()
    assert with_env.stdout == b"HOME= X=1\n"  # the docs: env replaces HOME, PATH…
    assert without.stdout.decode().startswith("HOME=") and without.stdout != b"HOME= X=\n"


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


def test_network_rules_apply_first_match(fake: FakeSprites, api: httpx.Client) -> None:
    deny_first = [{"domain": "*", "action": "deny"}, {"domain": "pypi.org", "action": "allow"}]
    allow_first = list(reversed(deny_first))
    assert closed(deny_first) and not allows(deny_first, "pypi.org")
    assert not closed(allow_first) and allows(allow_first, "pypi.org")
    assert not allows(allow_first, "example.com")
    assert allows([{"domain": "*.github.com", "action": "allow"}], "api.github.com")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake.world.hosts.update({"pypi.org": ("127.0.0.1", server.server_address[1])})
    try:
        make(api, "doc-net")
        answer = api.post("/v1/sprites/doc-net/policy/network", json={"rules": allow_first})
        assert answer.status_code == 204
        proxy = fake.world.sprites["doc-net"].proxy
        assert proxy is not None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
        with opener.open("http://pypi.org/", timeout=5) as reached:
            assert reached.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open("http://example.com/", timeout=5)
        refused.value.close()
        assert refused.value.code == 403
    finally:
        fake.world.hosts.clear()
        server.shutdown()
        server.server_close()
