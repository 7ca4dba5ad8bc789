"""``GET /docs``: Swagger UI over ``/openapi.json``, from this relay alone, under a strict CSP."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from relay.http.docs_page import ASSETS, CONTENT_SECURITY_POLICY
from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds

CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("docs"))
    server.add_token("dev")
    server.start()
    yield server
    server.stop()


def test_page_and_assets_answer_without_a_token_under_the_policy(relay: RelayProcess) -> None:
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    page = relay.get(None, "/docs")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "<script>" not in page.text  # the start script is a file, the policy allows no other
    assert relay.get(None, "/openapi.json").status_code == 200  # the same access as the docs
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert referenced, page.text
    for address in referenced:
        assert address.startswith("/docs/"), f"{address}: the page loads from this relay only"
        answer = relay.get(None, address)
        assert answer.status_code == 200, address
        assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert {address.removeprefix("/docs/") for address in referenced} == set(ASSETS)
    script = relay.get(None, "/docs/docs.js").text
    assert not re.search(r"https?://", script), script
    for other in ("index.html", "swagger-initializer.js", "oauth2-redirect.html", "..%2Fdocs.js"):
        assert relay.get(None, f"/docs/{other}").status_code == 404, other


@pytest.fixture(scope="module")
def rendered(relay: RelayProcess, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The page as Chromium renders it (its DOM), and Chromium's log."""
    if CHROMIUM is None:
        pytest.skip("chromium is absent (scripts/system-deps.sh test)")
    profile = tmp_path_factory.mktemp("profile")
    done = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr",
            "--v=0", "--virtual-time-budget=10000", "--dump-dom", f"{relay.url}/docs",
        ],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


@pytest.mark.browser
def test_chromium_renders_the_operations(rendered: tuple[str, str]) -> None:
    dom, log = rendered
    operations = set(
        re.findall(r'opblock-summary-method">([A-Z]+)</span>.*?data-path="([^"]+)"', dom)
    )
    for operation in [("POST", "/v1/runs"), ("GET", "/v1/runs/{run_id}"), ("GET", "/healthz")]:
        assert operation in operations, (operation, sorted(operations))
    blocked = [line for line in log.splitlines() if "Content Security Policy" in line]
    assert not blocked, blocked


@pytest.mark.browser
def test_chromium_shows_the_description_and_the_signed_webhook(rendered: tuple[str, str]) -> None:
    dom, _ = rendered
    description = dom.split('class="info__description', 1)[1].split("</section>", 1)[0]
    assert "declared jobs" in description and "Standard Webhooks" in description
    for link in ("/console", "/healthz"):
        assert f'href="{link}"' in description, link
    assert '<div class="webhooks"><h2>Webhooks</h2>' in dom
    webhooks = dom.split('<div class="webhooks">', 1)[1]
    method, name = re.findall(
        r'opblock-summary-method">([A-Z]+)</span>.*?data-path="([^"]+)"', webhooks
    )[0]
    assert (method, name) == ("POST", "runFinished")
    assert "A run ended: its callback_url receives it, signed" in webhooks
