"""``GET /``: where to go from here (issue 41): JSON for a program, a page of links for a
browser, pointing at the docs, the console and health, and saying nothing more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from relay.auth import new_token
from relay.http.app import create_app
from relay.http.openapi import document
from testing.relay_server import RelayProcess
from tests.conftest import make_settings


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("index"), providers="memory")
    server.add_token("ops", admin=True)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow  # needs a relay process: seconds
def test_the_root_points_at_the_docs_the_console_and_health(relay: RelayProcess) -> None:
    answer = httpx.get(relay.url + "/", timeout=10)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {
        "name": "relay",
        "docs": "/docs",
        "openapi": "/openapi.json",
        "console": "/console",
        "healthz": "/healthz",
        "readyz": "/readyz",
    }
    assert "accept" in answer.headers["vary"].lower()
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    page = httpx.get(relay.url + "/", headers={"Accept": browser}, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    for link in ("/docs", "/console", "/healthz"):
        assert f'href="{link}"' in page.text
    assert "get" in document()["paths"]["/"]  # described with the API
    for said in (answer.text, page.text):
        assert "version" not in said.lower() and relay.tokens["ops"] not in said
        assert "echo" not in said  # no job, no provider: what /healthz says, no more


def test_the_links_start_with_the_public_url_when_one_is_set(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, providers=["memory"], public_url="https://relay.example.com/base/"
    )
    new_token(settings.tokens_file, "ops")
    with TestClient(create_app(settings)) as client:
        answer = client.get("/", headers={"Host": "evil.example"})
    assert answer.json()["docs"] == "https://relay.example.com/base/docs"
    assert "evil" not in answer.text
