"""The relay command: tokens, jobs, run (exit codes), reap, and the stdlib client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.auth import TokenStore
from relay.client import parse_params
from tests.relay_server import RelayProcess


def relay_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("cli"), local_isolation="bwrap")
    server.add_token("cli")
    server.start()
    yield server
    server.stop()


def test_tokens_new_prints_once_and_list_never_shows_it(tmp_path: Path) -> None:
    made = relay_cli("tokens", "new", "bot", "--job", "echo", cwd=tmp_path)
    assert made.returncode == 0
    token = made.stdout.strip()
    assert token.startswith("rly_")
    listed = relay_cli("tokens", "list", cwd=tmp_path)
    assert "bot" in listed.stdout and "jobs=echo" in listed.stdout and token not in listed.stdout
    assert token not in (tmp_path / "tokens.toml").read_text()


def test_tokens_new_can_give_a_webhook_secret(tmp_path: Path) -> None:
    made = relay_cli("tokens", "new", "hooks", "--webhook-secret", cwd=tmp_path)
    assert made.returncode == 0 and "webhook_secret" in made.stderr
    (principal,) = TokenStore(tmp_path / "tokens.toml").principals
    assert principal.webhook_secret is not None and len(principal.webhook_secret) == 64
    assert principal.webhook_secret not in made.stdout + made.stderr


def test_jobs_lists_and_a_bad_manifest_exits_2(tmp_path: Path) -> None:
    listed = relay_cli("jobs", cwd=tmp_path, env={"RELAY_JOBS_DIR": str(Path.cwd() / "jobs")})
    assert listed.returncode == 0 and "echo" in listed.stdout
    (tmp_path / "jobs" / "broken").mkdir(parents=True)
    (tmp_path / "jobs" / "broken" / "job.toml").write_text("command = 1\n")
    bad = relay_cli("jobs", cwd=tmp_path, env={"RELAY_JOBS_DIR": str(tmp_path / "jobs")})
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "broken/job.toml: command" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_run_prints_output_and_exits_with_the_job_code(relay: RelayProcess) -> None:
    env = {"RELAY_URL": relay.url, "RELAY_TOKEN": relay.tokens["cli"]}
    ok = relay_cli("run", "echo", "-p", "message=hello there", cwd=relay.root, env=env)
    assert (ok.returncode, ok.stdout) == (0, "hello there\n")
    params = relay_cli(
        "run",
        "params",
        "-p",
        "name=n",
        "-p",
        "count:=3",
        "-p",
        'tags:=["ab"]',
        cwd=relay.root,
        env=env,
    )
    assert params.returncode == 0 and '"count": 3' in params.stdout


def test_run_exits_2_on_relay_errors(relay: RelayProcess) -> None:
    env = {"RELAY_URL": relay.url, "RELAY_TOKEN": "rly_wrong"}
    refused = relay_cli("run", "echo", "-p", "message=x", cwd=relay.root, env=env)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")
    assert "unknown token" not in refused.stderr  # an auth failure's body is never shown
    env["RELAY_TOKEN"] = relay.tokens["cli"]
    unknown = relay_cli("run", "nope", cwd=relay.root, env=env)
    assert unknown.returncode == 2 and "no job named" in unknown.stderr
    env["RELAY_URL"] = "http://127.0.0.1:9"
    down = relay_cli("run", "echo", "-p", "message=x", cwd=relay.root, env=env)
    assert down.returncode == 2 and "cannot reach" in down.stderr


def test_parse_params() -> None:
    assert parse_params(["a=b=c", "n:=3", "flag:=true", "url=http://x/?q:=1"]) == {
        "a": "b=c",
        "n": 3,
        "flag": True,
        "url": "http://x/?q:=1",
    }
    with pytest.raises(ValueError):
        parse_params(["novalue"])


def test_serve_dev_prints_a_curl_that_works(tmp_path: Path) -> None:
    import re
    import shlex
    import signal
    import time

    import httpx

    from tests.relay_server import REPO, free_port

    port = free_port()
    env = {"PATH": os.environ["PATH"], "RELAY_PORT": str(port), "RELAY_JOBS_DIR": str(REPO / "jobs"),
           "RELAY_LOCAL_ROOT": str(tmp_path / "sbx")}  # fmt: skip
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--dev"], cwd=tmp_path, env=env,
            stdout=handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with __import__("contextlib").suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            time.sleep(0.1)
        printed = out.read_text()
        line = next(x for x in printed.splitlines() if x.strip().startswith("curl"))
        line += " " + next(x for x in printed.splitlines() if "-d '" in x).strip()
        words = shlex.split(line.replace("\\", ""))
        header = words[words.index("-H") + 1]
        body = words[words.index("-d") + 1]
        assert re.fullmatch(r"Authorization: Bearer rly_\S+", header)
        answer = httpx.post(
            words[2], content=body, timeout=30,
            headers={"Authorization": header.split(": ", 1)[1], "Content-Type": "application/json"},
        )  # fmt: skip
        run = answer.json()
        assert run["state"] == "succeeded" and run["stdout"] == "hello from the relay\n"
        assert (tmp_path / ".relay-dev-token").read_text().strip() in header
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_dev_mode_without_bubblewrap_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import relay.providers.local.provider
    from relay.cli import _dev_isolation
    from relay.settings import Settings

    monkeypatch.setattr(relay.providers.local.provider, "bwrap_works", lambda: False)
    settings = _dev_isolation(Settings(_env_file=None))  # type: ignore[call-arg]
    assert settings.local_isolation == "none"
    assert "WITHOUT isolation" in capsys.readouterr().err
    explicit = Settings(_env_file=None, local_isolation="bwrap")  # type: ignore[call-arg]
    assert _dev_isolation(explicit).local_isolation == "bwrap"
