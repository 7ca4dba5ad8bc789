"""Jobs change without a restart (issue 41): a real ``relay serve`` reloads its jobs folder on
``SIGHUP`` and on ``relay jobs reload`` (``POST /v1/jobs/reload``): a job added, changed and
removed shows in ``/v1/jobs``, in runs and in ``/mcp``'s tools (whose open sessions are told);
a broken job file keeps the last good jobs, with one log line and ``/readyz`` saying why; a
reload racing requests being planned never answers a 500. And ``GET /`` says where to go."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds

GREET = """
description = "{description}"
command = [{command}, "{{who}}"]
[params.who]
type = "string"
required = true
max_length = 20
"""


def write_greet(relay: RelayProcess, description: str, *command: str) -> None:
    folder = relay.jobs_dir / "greet"
    folder.mkdir(exist_ok=True)
    words = ", ".join(json.dumps(word) for word in command)
    (folder / "job.toml").write_text(GREET.format(description=description, command=words))


def until(check: Callable[[], bool], within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def reloads(relay: RelayProcess) -> int:
    """The jobs reloads whose outcome the relay has logged (done or failed)."""
    return relay.log().count('"event": "jobs reload')


def reloaded_since(relay: RelayProcess, done: int) -> bool:
    return reloads(relay) > done


def job_names(relay: RelayProcess) -> dict[str, str]:
    """Each job the admin token sees, with its description."""
    listed = relay.get(relay.tokens["ops"], "/v1/jobs").json()["jobs"]
    return {job["name"]: job["description"] for job in listed}


def hang_up(relay: RelayProcess) -> None:
    assert relay.process is not None
    relay.process.send_signal(signal.SIGHUP)


def greet(relay: RelayProcess, who: str = "ann") -> httpx.Response:
    return relay.post(relay.tokens["ops"], {"job": "greet", "params": {"who": who}})


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path / "relay", providers="memory")
    server.add_token("ops", admin=True)
    server.add_token("user", jobs=["echo", "greet"])
    server.start()
    yield server
    server.stop()
    assert "unhandled error" not in server.log()


def test_sighup_picks_up_a_job_added_changed_and_removed(relay: RelayProcess) -> None:
    assert "greet" not in job_names(relay)
    write_greet(relay, "first", "echo")
    hang_up(relay)
    until(lambda: "greet" in job_names(relay))
    answer = greet(relay)
    assert answer.status_code == 200 and answer.json()["stdout"] == "ann\n", answer.text

    write_greet(relay, "second", "echo", "hello")
    hang_up(relay)
    until(lambda: job_names(relay).get("greet") == "second")
    assert greet(relay).json()["stdout"] == "hello ann\n"

    (relay.jobs_dir / "greet" / "job.toml").unlink()
    hang_up(relay)
    until(lambda: "greet" not in job_names(relay))
    gone = greet(relay)
    assert gone.status_code == 422 and gone.json()["error"]["code"] == "unknown_job"
    assert "relay jobs reload" in gone.json()["error"]["message"]
    assert "jobs reloaded: " in relay.log() and "removed greet" in relay.log()


def test_a_broken_job_file_keeps_the_last_good_jobs_and_says_why(relay: RelayProcess) -> None:
    assert relay.get(None, "/readyz").json()["checks"]["jobs"] == "ok"
    echo = relay.jobs_dir / "echo" / "job.toml"
    good = echo.read_text()
    echo.write_text(good.replace("command = [", "command = [[", 1))  # no longer TOML
    write_greet(relay, "new", "echo")  # a good change beside it waits for the folder
    hang_up(relay)
    until(lambda: relay.get(None, "/readyz").json()["checks"]["jobs"] != "ok")
    ready = relay.get(None, "/readyz")
    assert ready.status_code == 200, "the last good jobs still serve: still ready"
    health = ready.json()
    assert health["status"] == "degraded"
    said = health["checks"]["jobs"]
    assert said.startswith("the last reload failed, the last good jobs serve on: ")
    assert "echo/job.toml: not valid TOML" in said, said
    assert str(relay.jobs_dir) not in said  # /readyz answers anyone: no host path
    assert "greet" not in job_names(relay)  # nothing of a folder that does not load
    ran = relay.post(relay.tokens["ops"], {"job": "echo", "params": {"message": "still"}})
    assert ran.status_code == 200 and ran.json()["stdout"] == "still\n"
    failed = [line for line in relay.log().splitlines() if "jobs reload failed" in line]
    assert len(failed) == 1, failed
    line = json.loads(failed[0])
    assert line["level"] == "error"
    assert f"{echo}: not valid TOML" in line["event"], line

    echo.write_text(good)
    hang_up(relay)
    until(lambda: relay.get(None, "/readyz").json()["checks"]["jobs"] == "ok")
    assert relay.get(None, "/readyz").json()["status"] == "ok"
    assert "greet" in job_names(relay)


def relay_cli(relay: RelayProcess, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "RELAY_URL": relay.url, "RELAY_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "relay", "jobs", "reload", *args],
        cwd=relay.root, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_relay_jobs_reload_reloads_the_relay_or_says_why_not(relay: RelayProcess) -> None:
    write_greet(relay, "cli", "echo")
    done = relay_cli(relay, relay.tokens["ops"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("; added greet"), done.stdout
    assert greet(relay).json()["stdout"] == "ann\n"

    (relay.jobs_dir / "greet" / "job.toml").write_text('command = ["echo"]\nwarm = -1\n')
    refused = relay_cli(relay, relay.tokens["ops"])
    assert refused.returncode == 2, refused
    assert refused.stderr == "error: greet/job.toml: warm: must be a whole number from 0 to 64\n"
    assert greet(relay).json()["stdout"] == "ann\n"  # the last good greet serves on

    forbidden = relay_cli(relay, relay.tokens["user"])  # not an admin token
    assert forbidden.returncode == 3 and "admin" in forbidden.stderr

    write_greet(relay, "cli", "echo", "hi")
    as_json = relay_cli(relay, relay.tokens["ops"], "--json")
    assert as_json.returncode == 0, as_json.stderr
    answer = json.loads(as_json.stdout)
    assert answer["changed"] == ["greet"] and answer["added"] == answer["removed"] == []
    assert "greet" in answer["jobs"] and answer["warnings"] == []
    assert relay.get(None, "/readyz").json()["checks"]["jobs"] == "ok"


async def test_open_mcp_sessions_are_told_and_list_the_reloaded_tools(
    relay: RelayProcess,
) -> None:
    told = anyio.Event()

    async def on_message(message: Any) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            told.set()

    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {relay.tokens['user']}"},
        timeout=httpx2.Timeout(30, read=60),
    )
    transport = streamable_http_client(relay.url + "/mcp", http_client=http)
    async with (
        http,
        Client(transport, mode="legacy", message_handler=on_message) as client,
    ):
        tools = client.server_capabilities.tools
        assert tools is not None and tools.list_changed  # the server says it tells
        before = [tool.name for tool in (await client.list_tools()).tools]
        assert before == ["echo", "get_run"]
        write_greet(relay, "for the model", "echo")
        reloaded = httpx.post(
            relay.url + "/v1/jobs/reload", headers=relay.headers(relay.tokens["ops"]), timeout=30
        )
        assert reloaded.status_code == 200 and reloaded.json()["added"] == ["greet"]
        with anyio.fail_after(10):
            await told.wait()
        after = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert list(after) == ["echo", "greet", "get_run"]
        assert after["greet"].description == "for the model"
        result = await client.call_tool("greet", {"who": "bo"})
        assert not result.is_error and result.structured_content is not None
        assert result.structured_content["stdout"] == "bo\n"


def test_reloads_racing_requests_being_planned_never_answer_a_500(relay: RelayProcess) -> None:
    """Runs of a job that appears, changes its params, disappears and breaks while they are
    planned: each is a run or a clear 422, never a 500."""
    variants = [
        GREET.format(description="string", command='"echo"'),
        GREET.format(description="integer", command='"echo", "n"').replace(
            'type = "string"', 'type = "integer"'
        ),
        None,  # removed
        'command = ["echo", "{who}"]\n',  # broken: {who} names no param
    ]
    stop, cycled = threading.Event(), threading.Event()
    answers: list[tuple[int, str]] = []
    failures: list[str] = []

    def flip() -> None:
        folder = relay.jobs_dir / "greet"
        turn = 0
        while not stop.is_set():
            text = variants[turn % len(variants)]
            folder.mkdir(exist_ok=True)
            if text is None:
                (folder / "job.toml").unlink(missing_ok=True)
            else:
                (folder / "job.toml").write_text(text)
            if turn % 2:
                # The next variant is written once this one is read: a loaded relay may
                # handle the signal after it, and never see the broken one.
                done = reloads(relay)
                hang_up(relay)
                until(functools.partial(reloaded_since, relay, done), 30)
            else:
                answer = httpx.post(
                    relay.url + "/v1/jobs/reload",
                    headers=relay.headers(relay.tokens["ops"]),
                    timeout=30,
                )
                if answer.status_code not in (200, 422):
                    failures.append(f"reload: {answer.status_code} {answer.text}")
            turn += 1
            if turn == len(variants):
                cycled.set()
            time.sleep(0.01)

    def call(index: int) -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                who: Any = index if index % 2 else "ann"
                body = {"job": "greet", "params": {"who": who}, "wait": index % 3 != 0}
                answer = client.post(
                    relay.url + "/v1/runs", json=body, headers=relay.headers(relay.tokens["ops"])
                )
                code = (
                    answer.json().get("error", {}).get("code", "")
                    if answer.status_code >= 400
                    else ""
                )
                answers.append((answer.status_code, code))
                listed = client.get(
                    relay.url + "/v1/jobs", headers=relay.headers(relay.tokens["user"])
                )
                if listed.status_code != 200:
                    failures.append(f"jobs: {listed.status_code}")

    threads = [threading.Thread(target=flip)] + [
        threading.Thread(target=call, args=(index,)) for index in range(4)
    ]
    for thread in threads:
        thread.start()
    time.sleep(3)
    cycled.wait(60)  # every variant once, however slow a loaded relay reloads
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not failures, failures[:5]
    statuses = {status for status, _ in answers}
    assert statuses <= {200, 202, 422}, sorted(set(answers))
    codes = {code for status, code in answers if status == 422}
    assert codes <= {"unknown_job", "invalid_params"}, codes
    assert 200 in statuses or 202 in statuses, "no run was planned while the jobs changed"
    assert "jobs reloaded" in relay.log() and "jobs reload failed" in relay.log()
