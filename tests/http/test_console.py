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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from relay.http.console_page import ASSETS, CONTENT_SECURITY_POLICY
from relay.http.operator import MAX_SPEND_DAYS
from relay.runs.models import MAX_OUTCOME_HOURS, MAX_SEARCH_CHARS
from relay.store.schema import deliveries, runs
from testing.relay_server import REPO, RelayProcess
from testing.rows import run_row
from tests.receiver import Receiver

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is absent (scripts/system-deps.sh test)"
)
XSS = "<img src=x onerror=alert(1)><script>alert(2)</script>"
RATE = 0.01
"""USD per vCPU-second of the local provider here, so spend has something to add up."""
FAILURES = "failed,timed_out,error,lost"


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("console"),
        providers="local,memory",
        route="local",  # a job without a provider of its own runs on local alone
        cost_rates=json.dumps({"local": {"vcpu_s": RATE, "gib_s": 0}}),
        pool_warm=json.dumps({"echo": 1}),
        # Callbacks to a receiver on this machine, tried soon and retried much later.
        webhook_secret="console-test-webhook-secret",
        webhook_allow_http="true",
        webhook_allow_private="true",
        webhook_poll_s=0.2,
        webhook_backoff_s=600,
    )
    # A warm pool the health page shows, on a provider whose create is the wait; and echo's
    # warm on local, which a pool would slow down: shown as skipped, with why.
    (server.jobs_dir / "warmed").mkdir()
    (server.jobs_dir / "warmed" / "job.toml").write_text(
        'command = ["echo", "warm"]\nprovider = "memory"\nwarm = 1\n'
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
    assert [p["name"] for p in health["providers"]] == ["local", "memory"]
    assert health["webhooks"] == {"pending": 0, "oldest_pending_at": None}
    assert health["pools"]["size"] == 1 and health["pools"]["failed"] == 0
    (skipped,) = health["pools"]["skipped"]
    assert (skipped["job"], skipped["provider"]) == ("echo", "local")
    assert "costs less than a pool's claim" in skipped["reason"]
    spend = relay.get(admin, "/v1/spend", days="30").json()
    assert {row["token"] for row in spend["rows"]} >= {"nightly", "reports"}
    nightly_limits = next(t for t in spend["tokens"] if t["token"] == "nightly")["limits"]
    assert nightly_limits["runs_per_day"] == 50
    assert relay.get(admin, "/v1/spend", days="0").status_code == 400
    assert relay.get(admin, "/v1/spend", days=str(MAX_SPEND_DAYS)).status_code == 200
    assert relay.get(admin, "/v1/spend", days=str(MAX_SPEND_DAYS + 1)).status_code == 400


def test_list_entries_carry_their_request_and_are_found_by_id_text_and_states(
    relay: RelayProcess,
) -> None:
    admin, nightly = relay.tokens["ops"], relay.tokens["nightly"]
    asked = {"job": "params", "params": {"name": "listed", "tags": ["a", "b"]}}
    run = relay.post(nightly, asked).json()
    broken = relay.post(
        nightly,
        {"job": "python", "stdin": "raise SystemExit(3)", "env": {"API_KEY": "secret-env-value"}},
    ).json()
    assert broken["state"] == "failed" and broken["exit_code"] == 3
    listed = _list(relay, nightly, q=run["id"])
    (entry,) = listed.json()["runs"]
    assert entry["request"] == run["request"]  # what GET /v1/runs/{id} shows
    assert entry["request"]["params"] == asked["params"] and "stdout" not in entry
    secretive = _list(relay, nightly, q=broken["id"])
    assert secretive.json()["runs"][0]["request"]["env"] == ["API_KEY"]
    assert "secret-env-value" not in secretive.text
    # Several states at once; a text in the job's or token's name, in any case.
    ended = _list(relay, admin, state=FAILURES, token="nightly").json()["runs"]
    assert broken["id"] in [r["id"] for r in ended] and {r["state"] for r in ended} <= set(
        FAILURES.split(",")
    )
    assert {r["job"] for r in _list(relay, admin, q="PARAM").json()["runs"]} == {"params"}
    assert {r["token"] for r in _list(relay, admin, q="ightl").json()["runs"]} == {"nightly"}
    assert _list(relay, admin, q=run["id"][:-1]).json()["runs"] == []  # an id only whole
    assert _list(relay, nightly, q="reports").json()["runs"] == []  # its own runs only
    for odd in (
        {"state": "failed,nope"},
        {"state": "failed,"},
        {"q": "x" * (MAX_SEARCH_CHARS + 1)},
    ):
        refused = _list(relay, admin, **odd)
        assert refused.status_code == 400, odd
        assert refused.json()["error"]["code"] == "invalid_request"
    assert _list(relay, admin, q="a\x00b").status_code == 400


def test_outcomes_per_job_and_provider_are_for_admin_tokens(relay: RelayProcess) -> None:
    admin, nightly = relay.tokens["ops"], relay.tokens["nightly"]
    relay.post(nightly, {"job": "python", "stdin": "raise SystemExit(5)"})
    report = relay.get(admin, "/v1/outcomes", hours="1")
    assert report.status_code == 200, report.text
    body = report.json()
    assert body["hours"] == 1 and body["omitted"] == 0
    python = next(group for group in body["jobs"] if group["name"] == "python")
    assert python["failed"] >= 1 and python["failures"].get("exit 5", 0) >= 1
    assert python["last_failure"]["state"] == "failed"
    assert python["p50_ms"] is not None and python["p95_ms"] >= python["p50_ms"]
    local = next(group for group in body["providers"] if group["name"] == "local")
    assert local["runs"] >= python["runs"]
    assert relay.get(nightly, "/v1/outcomes").status_code == 403
    for hours in ("0", str(MAX_OUTCOME_HOURS + 1), "²", "1.5"):
        assert relay.get(admin, "/v1/outcomes", hours=hours).status_code == 400, hours
    assert relay.get(admin, "/v1/outcomes", days="1").status_code == 400
    health = relay.get(admin, "/v1/health").json()
    provider = next(p for p in health["providers"] if p["name"] == "local")
    assert provider["failed"] >= python["failed"] > 0  # every failure, not just error/lost


def test_pages_and_assets_answer_under_a_strict_policy(relay: RelayProcess) -> None:
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    for path in (
        "/console",
        "/console/jobs",
        "/console/spend",
        "/console/health",
        "/console/runs/run_0ab",
    ):
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


def _refused(status: int) -> str:
    """What Chromium logs of an API call the relay refused (the page says why itself)."""
    reason = {403: "Forbidden", 422: "Unprocessable Entity"}[status]
    return f"Failed to load resource: the server responded with a status of {status} ({reason})"


def _docs_picture(page: Any, name: str) -> None:
    from playwright.sync_api import expect

    if os.environ.get("CONSOLE_SCREENSHOTS") == "docs":
        expect(page.locator("body[data-ready]")).to_be_attached()  # its data drawn
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
    expect(page.locator("#providers tbody tr").first.locator("td").nth(1)).to_have_text("closed")
    expect(page.locator("#providers tbody tr").first.locator("td").nth(4)).to_have_text("none")
    expect(page.locator("#reaper")).to_contain_text("last sweep")
    expect(page.locator("#pools")).to_contain_text("ready / wanted")
    expect(page.locator("#pools")).to_contain_text("skipped: echo on local")
    expect(page.locator("#pools")).to_contain_text("costs less than a pool's claim")
    page.set_viewport_size({"width": 360, "height": 740})  # a phone: nothing wider than it
    for path in ("/console", "/console/spend"):
        page.goto(relay.url + path)
        expect(page.locator("body[data-ready]")).to_be_attached()
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 360, path
    assert page.problems == []


@needs_chromium
def test_the_runs_list_says_how_runs_ended_and_pages_past_the_newest(
    relay: RelayProcess, page: Any
) -> None:
    from playwright.sync_api import expect

    nightly = relay.tokens["nightly"]
    broken = relay.post(nightly, {"job": "python", "stdin": "raise SystemExit(7)"}).json()
    slow = relay.post(
        nightly, {"job": "python", "stdin": "import time; time.sleep(30)", "timeout_s": 0.5}
    ).json()
    assert (broken["state"], slow["state"]) == ("failed", "timed_out")
    _log_in(page, relay, relay.tokens["ops"], f"/console?state={FAILURES}")
    row = page.locator(f"tr[data-run-id='{broken['id']}']")
    expect(row.locator(".cell-ending")).to_have_text("exit 7")
    expect(page.locator(f"tr[data-run-id='{slow['id']}'] .cell-ending")).to_have_text("timed out")
    expect(page.locator("select[name=state]")).to_have_value(FAILURES)
    states = set(page.locator("#runs .cell-state").all_inner_texts())
    assert states and states <= set(FAILURES.split(","))
    # A whole run id finds that run; text finds runs by their job's or token's name.
    page.fill("input[name=q]", broken["id"])
    page.select_option("select[name=state]", "")
    page.keyboard.press("Enter")
    expect(page.locator("#runs tbody tr")).to_have_count(1)
    expect(row).to_be_visible()
    page.goto(relay.url + "/console?q=arams")
    expect(page.locator("#runs tbody tr").first).to_be_visible()
    assert set(page.locator("#runs .cell-job").all_inner_texts()) == {"params"}
    expect(page.locator("#runs .cell-asked").first).to_contain_text('"name":')  # what was asked
    # Past the newest page, by the API's cursor, and back.
    newest = [r["id"] for r in _list(relay, relay.tokens["ops"], limit="4").json()["runs"]]
    page.goto(relay.url + "/console?limit=2")
    expect(page.locator("#runs tbody tr")).to_have_count(2)
    expect(page.locator("#newest")).to_be_hidden()
    page.locator("#older").click()
    expect(page.locator("#runs tbody tr").first).to_have_attribute("data-run-id", newest[2])
    assert page.locator("#runs tbody tr").nth(1).get_attribute("data-run-id") == newest[3]
    assert "cursor=" in page.url and "limit=2" in page.url
    page.locator("#newest").click()
    expect(page.locator("#runs tbody tr").first).to_have_attribute("data-run-id", newest[0])
    # A phone: each run says its state, job and age, the columns around them fold away.
    page.set_viewport_size({"width": 360, "height": 740})
    page.goto(relay.url + f"/console?state={FAILURES}")
    card = page.locator(f"tr[data-run-id='{broken['id']}']")
    for part in (".cell-state", ".cell-job", ".cell-age", ".cell-id"):
        box = card.locator(part).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 360, part
    expect(card.locator(".cell-job")).to_have_text("python")
    expect(card.locator(".cell-age")).to_have_text(re.compile(r"^\d+ (s|min) ago$"))
    expect(card.locator(".cell-token")).to_be_hidden()
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 360
    _docs_picture(page, "console-phone.png")
    assert page.problems == []


@needs_chromium
def test_the_jobs_page_answers_what_is_failing(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    broken = relay.post(relay.tokens["nightly"], {"job": "python", "stdin": "exit(9)"}).json()
    command = relay.post(relay.tokens["reports"], {"command": ["sh", "-c", "exit 4"]}).json()
    assert (broken["exit_code"], command["exit_code"]) == (9, 4)
    _log_in(page, relay, relay.tokens["ops"], "/console/jobs")
    python = page.locator("#jobs tr[data-name='python']")
    expect(python.locator(".causes")).to_contain_text("exit 9 \N{MULTIPLICATION SIGN} 1")
    report = relay.get(relay.tokens["ops"], "/v1/outcomes", hours="24").json()
    counted = next(group for group in report["jobs"] if group["name"] == "python")
    rate = round(counted["success_rate"] * 100)
    expect(python.locator("td").nth(1)).to_have_text(f"{rate}%")
    expect(page.locator("#jobs tr[data-name='']")).to_contain_text("(command)")
    expect(page.locator("#jobs tr[data-name=''] .causes")).to_contain_text(
        "exit 4 \N{MULTIPLICATION SIGN} 1"
    )
    expect(page.locator("#job-providers tr[data-name='local']")).to_be_visible()
    _docs_picture(page, "console-jobs.png")
    # The last failure leads to its run; the failure count to the runs that failed.
    python.locator("td").last.locator("a").click()
    expect(page.locator("#run-state")).to_have_text("failed")
    assert page.url.endswith("/console/runs/" + broken["id"])
    page.go_back()
    python.locator("td").nth(2).locator("a").click()
    expect(page.locator("select[name=state]")).to_have_value(FAILURES)
    expect(page.locator("input[name=job]")).to_have_value("python")
    # The rows come from the page's own fetch: read them once the first is there.
    expect(page.locator("#runs .cell-job").first).to_be_visible()
    assert set(page.locator("#runs .cell-job").all_inner_texts()) == {"python"}
    page.goto(relay.url + "/console/jobs?hours=1")  # another window
    expect(page.locator("select[name=hours]")).to_have_value("1")
    expect(page.locator("#jobs tr[data-name='python']")).to_be_visible()
    assert page.problems == []


@needs_chromium
def test_a_run_page_shows_its_deliveries_and_counts_a_running_run_live(
    relay: RelayProcess, page: Any
) -> None:
    from playwright.sync_api import expect

    with Receiver(statuses=[503]) as receiver:
        started = relay.post(
            relay.tokens["nightly"],
            {
                "job": "sleep",
                # Long enough for a loaded host's log-in and first draw (2 s was not: the
                # page first showed the run ended, at 2.4 s, and nothing counted).
                "params": {"seconds": 6},
                "wait": False,
                "callback_url": receiver.url,
            },
        ).json()
        _log_in(page, relay, relay.tokens["ops"], f"/console/runs/{started['id']}")
        shown = page.locator("#run-duration")
        expect(shown).to_be_visible()
        expect(page.locator("#run-state")).to_have_text("running")
        first = shown.inner_text()
        expect(shown).not_to_have_text(first)  # it counts while the run runs
        expect(page.locator("#run-state")).to_have_text("succeeded", timeout=30_000)
        receiver.wait_for(started["id"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the attempt is recorded after its answer
            run = relay.get(relay.tokens["nightly"], f"/v1/runs/{started['id']}").json()
            if run["deliveries"] and run["deliveries"][0]["attempts"]:
                break
            time.sleep(0.1)
        page.reload()
        delivery = page.locator("#deliveries tbody tr")
        expect(delivery).to_have_count(1)
        expect(delivery.locator(".state")).to_have_text("pending")
        expect(delivery.locator("td").nth(2)).to_have_text("1")
        expect(delivery.locator(".attempts")).to_contain_text("HTTP 503")
        expected = run["deliveries"][0]["next_attempt_at"].replace("T", " ")[:16]
        expect(delivery.locator("td").nth(3)).to_contain_text(expected)  # the next retry
        # The one attempt that ran it: its provider and sandbox, no error.
        attempt = page.locator("#attempts tbody tr[data-provider='local']")
        expect(attempt).to_have_count(1)
        expect(attempt.locator("td").nth(2)).to_have_text(run["sandbox_id"])
        expect(attempt.locator("td").nth(5)).to_have_text("\u2013")  # an en dash: no error
    page.goto(relay.url + f"/console/runs/{run['id']}")
    _docs_picture(page, "console-run.png")
    assert page.problems == []


@needs_chromium
def test_an_admin_re_runs_a_request_that_keeps_no_secret_and_is_told_why_not_otherwise(
    relay: RelayProcess, page: Any
) -> None:
    from playwright.sync_api import expect

    admin, nightly = relay.tokens["ops"], relay.tokens["nightly"]
    asked = {"job": "sleep", "params": {"seconds": 0}, "timeout_s": 20}
    original = relay.post(nightly, asked).json()
    _log_in(page, relay, admin, f"/console/runs/{original['id']}")
    expect(page.locator("#rerun-note")).to_contain_text("not nightly's")
    page.locator("#rerun").focus()
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/console/runs/" in url and original["id"] not in url)
    again_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("#run-state")).to_have_text("succeeded")
    again = relay.get(admin, f"/v1/runs/{again_id}").json()
    assert again["token"] == "ops"  # the admin's run, through POST /v1/runs
    assert again["request"]["params"] == asked["params"]
    assert again["request"]["timeout_s"] == 20 and again["request"]["wait"] is False
    assert again["stdout"] == original["stdout"]
    # A request whose env, files or stdin the relay did not keep cannot be rebuilt.
    secret = relay.post(
        nightly, {"job": "python", "stdin": "print(1)", "env": {"API_KEY": "v"}}
    ).json()
    page.goto(relay.url + f"/console/runs/{secret['id']}")
    expect(page.locator("#rerun-note")).to_contain_text("the values of its env (API_KEY)")
    expect(page.locator("#rerun-note")).to_contain_text("its stdin (8 bytes)")
    expect(page.locator("#rerun")).to_be_hidden()
    # Every check of the API applies: this admin token has no `command` scope.
    command = relay.post(relay.tokens["reports"], {"command": ["true"]}).json()
    page.goto(relay.url + f"/console/runs/{command['id']}")
    page.locator("#rerun").click()
    expect(page.locator("#rerun-result")).to_contain_text("Refused:")
    expect(page.locator("#content")).to_be_visible()  # still logged in
    assert page.problems == [_refused(403)]


def _put_hostile_run(relay: RelayProcess) -> str:
    """A run in the relay's database whose job, token, error and webhook attempt are markup
    (as another replica or an older relay might have written them); its id."""
    run_id = "run_0badc0de"
    now = time.time()
    request = {"job": XSS, "params": {"name": XSS}, "env": [], "files": [], "stdin_bytes": 0}

    record = run_row(
        run_id,
        job=XSS,
        token=XSS,
        state="error",
        error_code=XSS,
        error_message=XSS,
        request=json.dumps(request),
        callback_url="https://hooks.example/",
        ended_at=now,
    )
    attempt = {"attempt": 1, "at": now, "error": XSS, "duration_ms": 3}
    delivery = {
        "id": "dlv_0badc0de", "run_id": run_id, "token": XSS, "url": "https://x/",
        "state": "failed", "attempts": 1, "attempt_log": json.dumps([attempt]),
        "created_at": now, "next_attempt_at": now,
    }  # fmt: skip
    # Written beside the running relay, as another process would (SQLite waits its turn).
    engine = sa.create_engine(f"sqlite:///{relay.root / 'relay.db'}")
    try:
        with engine.begin() as conn:
            conn.execute(runs.insert().values(**record.columns()))
            conn.execute(deliveries.insert().values(**delivery))
    finally:
        engine.dispose()
    return run_id


@needs_chromium
def test_output_params_names_and_errors_render_as_text(relay: RelayProcess, page: Any) -> None:
    from playwright.sync_api import expect

    answer = relay.post(relay.tokens["nightly"], {"job": "params", "params": {"name": XSS}})
    assert answer.status_code == 200, answer.text
    run = answer.json()
    assert XSS in run["stdout"]
    _log_in(page, relay, relay.tokens["ops"], f"/console/runs/{run['id']}")
    expect(page.locator("#stdout")).to_contain_text(XSS)
    expect(page.locator("#run-request")).to_contain_text(json.dumps(XSS)[1:-1])
    assert page.locator("main img, main script").count() == 0
    # A job, a token, an error and a webhook attempt that are markup, on every page.
    hostile = _put_hostile_run(relay)
    page.goto(relay.url + f"/console/runs/{hostile}")
    expect(page.locator("#run-facts")).to_contain_text(f"{XSS}: {XSS}")  # code: message
    expect(page.locator("#deliveries .attempts")).to_contain_text(XSS)
    page.locator("#rerun").click()  # the API refuses such a job name; its answer is text
    expect(page.locator("#rerun-result")).to_contain_text("Refused:")
    page.goto(relay.url + f"/console?q={hostile}")
    listed = page.locator(f"tr[data-run-id='{hostile}']")
    expect(listed.locator(".cell-job")).to_have_text(XSS)
    expect(listed.locator(".cell-ending")).to_have_text(XSS)
    expect(listed.locator(".cell-asked")).to_contain_text("<img")
    page.goto(relay.url + "/console/jobs")
    expect(page.locator("#jobs")).to_contain_text(XSS)
    expect(page.locator("#jobs .causes").filter(has_text=XSS)).to_have_count(1)
    assert page.locator("main img, main script").count() == 0
    # No alert, nothing refused by the policy: only the API's refusal of the re-run.
    assert page.problems == [_refused(422)]


@needs_chromium
def test_a_run_page_previews_and_downloads_its_artifacts_as_text_safe_as_the_rest(
    relay: RelayProcess, page: Any
) -> None:
    from playwright.sync_api import expect

    chart = relay.post(relay.tokens["nightly"], {"job": "chart"}).json()
    assert [entry["name"] for entry in chart["artifacts"]] == ["out/chart.png", "out/report.json"]
    _log_in(page, relay, relay.tokens["ops"], f"/console/runs/{chart['id']}")
    rows = page.locator("#artifacts tbody tr")
    expect(rows).to_have_count(2)
    rows.nth(0).get_by_role("button", name="Preview").click()
    image = page.locator("#artifact-preview img")
    expect(image).to_have_attribute("src", re.compile(r"^blob:"))  # fetched with the token
    page.wait_for_function(
        "() => document.querySelector('#artifact-preview img').naturalWidth === 240"
    )
    with page.expect_download() as download:
        rows.nth(1).get_by_role("button", name="Download").click()
    assert download.value.suggested_filename == "report.json"
    assert json.loads(Path(download.value.path()).read_text())["bars"] == [3, 7, 5, 9]
    # A job's file names and contents are markup: shown as text, never run.
    script = f"mkdir out && printf '%s' '{XSS}' > 'out/<img src=x onerror=alert(1)>.txt'"
    hostile = relay.post(
        relay.tokens["reports"], {"command": ["sh", "-c", script], "artifacts": ["out/*", "gone"]}
    ).json()
    page.goto(relay.url + f"/console/runs/{hostile['id']}")
    rows = page.locator("#artifacts tbody tr")
    expect(rows.nth(0)).to_contain_text("out/<img src=x onerror=alert(1)>.txt")
    expect(rows.nth(1)).to_contain_text("not kept: not found")
    rows.nth(0).get_by_role("button", name="Preview").click()
    expect(page.locator("#artifact-preview pre")).to_have_text(XSS)
    assert page.locator("main script, #artifacts img").count() == 0
    assert page.problems == []
