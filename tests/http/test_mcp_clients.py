"""``/mcp`` through clients nobody here wrote, against a real ``relay serve``: the official
MCP TypeScript SDK (``tests/mcp_client/check.mjs``, and the README's example as printed) and
the MCP Inspector CLI (the README's commands as printed).

Their npm packages are pinned in ``tests/mcp_client/package-lock.json`` and installed here
with ``npm ci`` (Debian's ``nodejs``/``npm``, from scripts/system-deps.sh), again only when the
lock changes: ``node_modules`` stays between runs and is never committed. ``package.json``
overrides the SDK's ``@hono/node-server`` (a server part a client never loads) with 1.19, the
line that still runs on Debian 12's Node 18.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from relay.runs.catalog import Catalog
from testing.host import sleep_marker
from testing.relay_server import RelayProcess
from tests.conftest import REPO

CLIENT = REPO / "tests" / "mcp_client"
README_HOST = "https://relay.your-domain"
"""The relay's URL as the README's MCP examples write it."""
NPM_TIMEOUT_S = 600
CANCELED_SLEEP = sleep_marker(364)
"""The seconds check.mjs's canceled run sleeps: its process is found by them."""

pytestmark = pytest.mark.node  # the official TypeScript SDK and the Inspector, on Node


def node_major() -> int:
    version = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True)
    return int(version.stdout.strip().lstrip("v").split(".")[0])


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """``npm ci`` of tests/mcp_client, unless its node_modules is of the committed lock."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node or npm missing: scripts/system-deps.sh installs Debian's nodejs, npm")
    lock = CLIENT / "package-lock.json"
    wanted = hashlib.sha256(lock.read_bytes() + (CLIENT / "package.json").read_bytes()).hexdigest()
    stamp = CLIENT / "node_modules" / ".relay-installed"
    with (CLIENT / ".npm-install.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # two suites at once install once
        if not stamp.exists() or stamp.read_text() != wanted:
            # No install scripts: nothing from the registry runs at install time.
            subprocess.run(
                ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=CLIENT, check=True, timeout=NPM_TIMEOUT_S,
                env={**os.environ, "npm_config_update_notifier": "false"},
            )  # fmt: skip
            stamp.write_text(wanted)
    return CLIENT / "node_modules"


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("relay"),
        max_wait_s=2,
        local_isolation="bwrap",
        # A price for local runs, so a daily budget can refuse one (the worst case: 10 s of
        # echo at 1 vCPU is 10 USD).
        cost_rates=json.dumps({"local": {"vcpu_s": 1.0}}),
    )
    server.add_token("ops", command=True)
    server.add_token("echo-only", jobs=["echo"])
    server.add_token("once", jobs=["echo"], limits={"runs_per_day": 1})
    server.add_token("broke", jobs=["echo"], limits={"usd_per_day": 0.01})
    server.add_token("shrinking", jobs=["echo", "sleep"])
    server.start()
    yield server
    server.stop()
    assert "unhandled error" not in server.log() and "mcp tool failed" not in server.log()


def node_env(relay: RelayProcess, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(relay.root),  # npm's cache and config, the Inspector's files: not ours
        "RELAY_MCP_URL": relay.url + "/mcp",
        "RELAY_TOKENS": json.dumps(relay.tokens),
        "RELAY_CANCELED_SLEEP": CANCELED_SLEEP,
        "npm_config_yes": "false",  # npx: what is not in node_modules is not downloaded
        "npm_config_update_notifier": "false",
        **extra,
    }


def take_sleep_from_shrinking(relay: RelayProcess) -> None:
    tokens = relay.tokens_file.read_text()
    block = tokens.index("[tokens.shrinking]")
    shrunk = tokens[block:].replace('jobs = ["echo", "sleep"]', 'jobs = ["echo"]', 1)
    assert shrunk != tokens[block:]
    relay.tokens_file.write_text(tokens[:block] + shrunk)


def run_check(relay: RelayProcess) -> dict[str, Any]:
    """check.mjs's report; in between, the token "shrinking" loses the job "sleep"."""
    process = subprocess.Popen(
        ["node", "check.mjs"],
        cwd=CLIENT, env=node_env(relay), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    try:
        waiting = process.stdout.readline()
        assert json.loads(waiting or "{}") == {"waiting": "shrink"}, waiting
        take_sleep_from_shrinking(relay)
        process.stdin.write("go\n")
        process.stdin.flush()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    report: dict[str, Any] = json.loads(out.splitlines()[-1])["report"]
    return report


def sandbox_processes(marker: str) -> list[list[str]]:
    return [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and p.info["cmdline"][:2] == ["sleep", marker]
    ]


REFUSALS = {
    "invalid_type": "invalid_params",
    "param_as_option": "invalid_params",
    "unknown_argument": "invalid_params",
    "validation": "validation_error",
    "unknown_run": "not_found",
    "limit": "rate_limited",
    "budget": "budget_exceeded",
    "no_command_scope": "forbidden",
    "forbidden_job": "forbidden",
}
"""Each refused call of check.mjs, and the relay's error code its text must name."""


def test_the_typescript_sdk_reads_every_answer_and_every_refusal(
    node_modules: Path, relay: RelayProcess
) -> None:
    report = run_check(relay)
    catalog = Catalog.load(relay.jobs_dir)
    assert report["protocolVersion"] == "2025-11-25"
    assert set(report["tools"]["ops"]) == {*catalog.jobs, "run_command", "get_run"}
    assert report["tools"]["echo-only"] == ["echo", "get_run"]
    assert report["tools"]["shrinking"] == ["echo", "sleep", "get_run"]
    calls = report["calls"]
    for label, code in REFUSALS.items():
        call = calls[label]
        assert "thrown" not in call, (label, call)  # the client read it: no protocol error
        assert call["isError"] and call["structured"] is None, (label, call)
        assert len(call["text"]) == 1 and call["text"][0].startswith(f"{code}: "), (label, call)
    assert "starts with '-'" in calls["param_as_option"]["text"][0]
    assert re.search(r"\(retry after [1-9][0-9]* s\)$", calls["limit"]["text"][0])
    # No tool at all: that, and only that, is a protocol error (-32602, invalid params).
    assert calls["unknown_tool"]["code"] == -32602, calls["unknown_tool"]

    # Runs: their structured content passed the client's check against the Run schema.
    progress = calls["progress"]
    assert "thrown" not in progress, progress  # what the client threw, not a KeyError
    assert not progress["isError"] and progress["text"] == ["line1\nline2\nline3\n"]
    assert "".join(p["message"] for p in progress["progress"]) == "line1\nline2\nline3\n"
    done = [p["progress"] for p in progress["progress"]]
    assert done == sorted(done) and len(set(done)) == len(done)
    for label, state in [("failed", "failed"), ("timed_out", "timed_out")]:
        call = calls[label]
        assert "thrown" not in call and call["isError"], (label, call)
        assert call["structured"]["state"] == state
    assert calls["failed"]["structured"]["exit_code"] == 7
    running = calls["still_running"]
    assert not running["isError"] and running["structured"]["state"] == "running", running
    assert "get_run" in running["text"][1]
    assert calls["get_run"]["structured"]["id"] == running["structured"]["id"]
    assert calls["first"]["text"] == ["one\n"] and not calls["first"]["isError"]

    # The cancel: the client gave up at the first output; the run is canceled, its sandbox
    # gone, and the session still serves.
    assert calls["canceled"]["thrown"].endswith("the user stopped it"), calls["canceled"]
    assert calls["after_cancel"]["text"] == ["still here\n"]
    canceled: list[dict[str, Any]] = []
    for _ in range(50):  # the only run of ops to be canceled
        canceled = relay.get(relay.tokens["ops"], "/v1/runs", state="canceled").json()["runs"]
        if canceled:
            break
        time.sleep(0.1)
    assert len(canceled) == 1, canceled
    run = relay.get(relay.tokens["ops"], f"/v1/runs/{canceled[0]['id']}").json()
    assert run["stdout"] == "up\n" and run["exit_code"] is None
    assert sandbox_processes(CANCELED_SLEEP) == []


def readme_mcp_section() -> str:
    readme = (REPO / "README.md").read_text()
    return readme.split("\n## MCP: the jobs as tools for a model\n")[1].split("\n## ")[0]


def test_the_readmes_typescript_example_runs_as_printed(
    node_modules: Path, relay: RelayProcess
) -> None:
    blocks = re.findall(r"^```js\n(.*?)^```", readme_mcp_section(), re.S | re.M)
    assert len(blocks) == 1
    assert README_HOST + "/mcp" in blocks[0]
    script = blocks[0].replace(README_HOST, relay.url)
    done = subprocess.run(
        ["node", "--input-type=module", "-"],  # imports resolve from cwd: tests/mcp_client
        input=script, cwd=CLIENT, capture_output=True, text=True, timeout=60, check=False,
        env=node_env(relay, RELAY_TOKEN=relay.tokens["echo-only"]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["echo get_run", "ran: hi"]


def test_the_readmes_inspector_commands_run_as_printed(
    node_modules: Path, relay: RelayProcess
) -> None:
    if node_major() < 20:
        pytest.skip("the Inspector 2.12.0 declares Node >= 22.19; it is checked here on 20")
    blocks = re.findall(r"^```sh\n(.*?)^```", readme_mcp_section(), re.S | re.M)
    commands = [
        line
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("npx @modelcontextprotocol/inspector@")
    ]
    assert len(commands) == 2
    token = relay.tokens["echo-only"]
    outputs = []
    for command in commands:
        assert f"{README_HOST}/mcp" in command and "<your-token>" in command
        line = command.replace(README_HOST, relay.url).replace("<your-token>", token)
        done = subprocess.run(
            ["bash", "-e", "-c", line],
            cwd=CLIENT, env=node_env(relay), capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        outputs.append(json.loads(done.stdout))
    listed, called = outputs
    assert [tool["name"] for tool in listed["tools"]] == ["echo", "get_run"]
    assert called["isError"] is False and called["content"][0]["text"] == "hi\n"
    assert called["structuredContent"]["state"] == "succeeded"
    # A refusal the same way: text with the relay's code, exit code 5.
    refused = commands[1].replace(README_HOST, relay.url).replace("<your-token>", token)
    done = subprocess.run(
        ["bash", "-c", refused.replace("message=hi", "message=--version")],
        cwd=CLIENT, env=node_env(relay), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert json.loads(done.stderr)["error"]["code"] == "tool_is_error"
    shown = json.loads(done.stdout)
    assert shown["isError"] is True and "structuredContent" not in shown
    assert shown["content"][0]["text"].startswith("invalid_params: ")
