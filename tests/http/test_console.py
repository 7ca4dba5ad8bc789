"""The admin scope and ``/console``: a real relay, driven by Debian's headless Chromium.

Playwright for Python drives ``/usr/bin/chromium`` (no browser download). A failing
browser test leaves a screenshot (``TEST_SCREENSHOTS_DIR``, else the test's tmp dir);
``CONSOLE_SCREENSHOTS=docs`` also writes the README's pictures to docs/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.http.console_page import ASSETS, CONTENT_SECURITY_POLICY
from relay.http.operator import MAX_SPEND_DAYS
from tests.relay_server import REPO, RelayProcess

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is absent (scripts/system-deps.sh test)"
)
XSS = "<img src=x onerror=alert(1)><script>alert(2)</script>"
RATE = 0.01
"""USD per vCPU-second of the local provider here, so spend has something to add up."""


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("console"),
        cost_rates=json.dumps({"local": {"vcpu_s": RATE, "gib_s": 0}}),
        pool_warm=json.dumps({"echo": 1}),  # a warm pool the health page shows
    )
    server.add_token("ops", admin=True)
    server.add_token("nightly", limits={"runs_per_day": 50, "usd_per_day": 5})
    server.add_token("reports", command=True)
    server.start()
    yield server
    server.stop()


def _list(relay: RelayProcess, caller: str, **params: str) -> httpx.Response:
    return httpx.get(
        relay.url + "/v1/runs", params=params, headers=relay.headers(caller), timeout=30
    )


def test_admin_scope_reads_every_token_and_the_rest_stays_per_token(relay: RelayProcess) -> None:
    admin, nightly, reports = (relay.tokens[name] for name in ("ops", "nightly", "reports"))
    asked = relay.post(
        nightly,
        {
            "job": "python",
            "stdin": "print(1)  # secret-stdin-value",
            "env": {"API_KEY": "secret-env-value"},
        },
    )
    assert asked.status_code == 200, asked.text
    run = asked.json()
    assert run["token"] == "nightly"
    assert run["request"]["env"] == ["API_KEY"]  # names only
    assert run["request"]["stdin_bytes"] == len("print(1)  # secret-stdin-value")
    other = relay.post(reports, {"command": ["true"]}).json()
    # A token still sees only its own; another token's name is refused, its runs absent.
    assert {r["token"] for r in _list(relay, nightly).json()["runs"]} == {"nightly"}
    assert _list(relay, nightly, token="reports").status_code == 403
    assert relay.get(nightly, f"/v1/runs/{other['id']}").status_code == 404
    assert relay.delete(nightly, f"/v1/runs/{other['id']}").status_code == 404
    assert relay.get(nightly, "/v1/health").status_code == 403
    assert {row["token"] for row in relay.get(nightly, "/v1/spend").json()["rows"]} == {"nightly"}
    # The admin reads every token's, filters by token, provider and time.
    assert {r["token"] for r in _list(relay, admin).json()["runs"]} >= {"nightly", "reports"}
    assert [r["id"] for r in _list(relay, admin, token="reports").json()["runs"]] == [other["id"]]
    assert _list(relay, admin, provider="nope").json()["runs"] == []
    assert _list(relay, admin, since="2999-01-01T00:00:00Z").json()["runs"] == []
    assert _list(relay, admin, since="yesterday").status_code == 400
    seen = relay.get(admin, f"/v1/runs/{run['id']}")
    assert seen.status_code == 200
    assert "secret-env-value" not in seen.text and "secret-stdin-value" not in seen.text
    health = relay.get(admin, "/v1/health").json()
    assert [p["name"] for p in health["providers"]] == ["local"]
    assert health["webhooks"] == {"pending": 0, "oldest_pending_at": None}
    assert health["pools"]["size"] == 1 and health["pools"]["failed"] == 0
    spend = relay.get(admin, "/v1/spend", days="30").json()
    assert {row["token"] for row in spend["rows"]} >= {"nightly", "reports"}
    nightly_limits = next(t for t in spend["tokens"] if t["token"] == "nightly")["limits"]
    assert nightly_limits["runs_per_day"] == 50
    assert relay.get(admin, "/v1/spend", days="0").status_code == 400
    assert relay.get(admin, "/v1/spend", days=str(MAX_SPEND_DAYS)).status_code == 200
    assert relay.get(admin, "/v1/spend", days=str(MAX_SPEND_DAYS + 1)).status_code == 400


def test_pages_and_assets_answer_under_a_strict_policy(relay: RelayProcess) -> None:
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    for path in ("/console", "/console/spend", "/console/health", "/console/runs/run_0ab"):
        page = relay.get(None, path)
        assert page.status_code == 200, path
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), "no inline script"
        assert not re.search(r"\sstyle=|<style", page.text), "no inline style"
        for address in re.findall(r'(?:src|href)="(/[^"]*)"', page.text):
            assert relay.get(None, address).status_code == 200, address
    assert relay.get(None, "/console/runs/<script>").status_code == 404
    assert relay.get(None, "/console/static/console_page.py").status_code == 404
    script = relay.get(None, "/console/static/console.js").text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", script)
    assert set(ASSETS) == {"console.js", "console.css", "favicon.svg"}


# -- the browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("chromium is absent (scripts/system-deps.sh test)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        launched = driver.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh tab (its own sessionStorage); a screenshot of it if the test fails."""
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    problems: list[str] = []

    def on_console(message: Any) -> None:
        if message.type == "error":  # a script error, or something the policy refused
            problems.append(message.text)

    def on_dialog(dialog: Any) -> None:
        problems.append("dialog: " + dialog.message)
        dialog.dismiss()

    tab.on("console", on_console)
    tab.on("dialog", on_dialog)
    tab.problems = problems
    failed_before = request.session.testsfailed
    yield tab
    if request.session.testsfailed > failed_before:
        folder = Path(os.environ.get("TEST_SCREENSHOTS_DIR", tmp_path))
        folder.mkdir(parents=True, exist_ok=True)
        shot = folder / f"{request.node.name}.png"
        tab.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
    context.close()


def _log_in(page: Any, relay: RelayProcess, token: str, path: str = "/console") -> None:
    from playwright.sync_api import expect

    page.goto(relay.url + path)
    expect(page.locator("#token-input")).to_be_focused()  # by keyboard alone from here
    page.keyboard.type(token)
    page.keyboard.press("Enter")


def _docs_picture(page: Any, name: str) -> None:
    if os.environ.get("CONSOLE_SCREENSHOTS") == "docs":
        page.screenshot(path=str(REPO / "docs" / name), full_page=True)


@needs_chromium
def test_a_non_admin_token_is_refused(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    _log_in(page, relay, relay.tokens["nightly"])
    expect(page.locator("#message")).to_contain_text("not an admin token")
    expect(page.locator("#content")).to_be_hidden()
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("() => sessionStorage.length") == 0  # a refused token is not kept


@needs_chromium
def test_follow_a_run_live_and_cancel_it(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    _log_in(page, relay, relay.tokens["ops"])
    expect(page.locator("#runs tbody tr").first).to_be_visible()
    assert relay.tokens["ops"] not in page.url
    started = relay.post(
        relay.tokens["nightly"], {"job": "sleep", "params": {"seconds": 30}, "wait": False}
    ).json()
    row = page.locator(f"tr[data-run-id='{started['id']}']")
    expect(row).to_be_visible()  # the list refreshes by itself
    expect(row.locator(".state")).to_have_class(re.compile(r"state-(starting|running)"))
    _docs_picture(page, "console-runs.png")
    row.locator("a").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#stdout")).to_have_text("sleeping\n")  # live, from the events
    expect(page.locator("#run-request")).to_contain_text('"seconds": 30')
    page.locator("#cancel").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#run-state")).to_have_text("canceled")
    expect(page.locator("#cancel")).to_be_hidden()
    assert relay.get(relay.tokens["nightly"], f"/v1/runs/{started['id']}").json()["state"] == (
        "canceled"
    )
    assert "run canceled by an admin token" in relay.log()  # who ended another token's run
    assert page.problems == []


@needs_chromium
def test_spend_chart_adds_up(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    report = relay.get(relay.tokens["ops"], "/v1/spend", days="30").json()
    runs = sum(row["runs"] for row in report["rows"])
    usd = sum(row["usd"] for row in report["rows"])
    assert runs >= 2 and usd > 0
    _log_in(page, relay, relay.tokens["ops"], "/console/spend")
    expect(page.locator("#spend-total")).to_contain_text(f"{runs} runs, ${usd:.4f} over 30 days")
    chart = page.locator("#usd-chart svg")
    assert float(chart.get_attribute("data-total")) == pytest.approx(usd)
    assert float(page.locator("#runs-chart svg").get_attribute("data-total")) == runs
    assert chart.locator("rect").count() >= 1
    expect(page.locator("#limits")).to_contain_text("/ 50")  # nightly's runs_per_day
    _docs_picture(page, "console-spend.png")
    page.goto(relay.url + "/console/health")  # the token stays for the tab
    expect(page.locator("#providers")).to_contain_text("local")
    expect(page.locator("#reaper")).to_contain_text("last sweep")
    expect(page.locator("#pools")).to_contain_text("ready / wanted")
    page.set_viewport_size({"width": 360, "height": 740})  # a phone: nothing wider than it
    for path in ("/console", "/console/spend"):
        page.goto(relay.url + path)
        expect(page.locator("body[data-ready]")).to_be_attached()
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 360, path
    assert page.problems == []


@needs_chromium
def test_output_and_params_render_as_text(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    answer = relay.post(relay.tokens["nightly"], {"job": "params", "params": {"name": XSS}})
    assert answer.status_code == 200, answer.text
    run = answer.json()
    assert XSS in run["stdout"]
    _log_in(page, relay, relay.tokens["ops"], f"/console/runs/{run['id']}")
    expect(page.locator("#stdout")).to_contain_text(XSS)
    expect(page.locator("#run-request")).to_contain_text(json.dumps(XSS)[1:-1])
    assert page.locator("main img, main script").count() == 0
    assert page.problems == []  # no alert, nothing refused by the policy
