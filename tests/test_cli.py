"""The relay command: tokens, jobs, run (exit codes), reap, and the stdlib client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from relay.auth import TokenStore
from relay.cli.runs import COLUMNS
from relay.client import parse_params
from testing.relay_server import RelayProcess, free_port, tied_to_this_process

# A `python -m relay` process (~1.5 s of CPU) per command, many of them.
pytestmark = pytest.mark.slow


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
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()


def test_tokens_new_prints_once_and_list_never_shows_it(tmp_path: Path) -> None:
    jobs = {"RELAY_JOBS_DIR": str(Path.cwd() / "jobs")}
    made = relay_cli("tokens", "new", "bot", "--job", "echo", cwd=tmp_path, env=jobs)
    assert made.returncode == 0
    token = made.stdout.strip()
    assert token.startswith("rly_")
    listed = relay_cli("tokens", "list", cwd=tmp_path)
    assert "bot" in listed.stdout and "jobs=echo" in listed.stdout and token not in listed.stdout
    assert token not in (tmp_path / "tokens.toml").read_text()
    assert relay_cli("tokens", "new", "operator", "--admin", cwd=tmp_path).returncode == 0
    admins = relay_cli("tokens", "list", cwd=tmp_path).stdout
    assert [line.split()[0] for line in admins.splitlines() if " admin" in line] == ["operator"]


def test_tokens_new_can_give_a_webhook_secret(tmp_path: Path) -> None:
    made = relay_cli("tokens", "new", "hooks", "--webhook-secret", cwd=tmp_path)
    assert made.returncode == 0 and "webhook_secret" in made.stderr
    (principal,) = TokenStore(tmp_path / "tokens.toml").principals
    assert principal.webhook_secret is not None and principal.webhook_secret.startswith("whsec_")
    assert principal.webhook_secret not in made.stdout + made.stderr


def test_jobs_lists_and_a_bad_manifest_exits_2(tmp_path: Path) -> None:
    listed = relay_cli("jobs", cwd=tmp_path, env={"RELAY_JOBS_DIR": str(Path.cwd() / "jobs")})
    assert listed.returncode == 0 and "echo" in listed.stdout
    as_json = relay_cli("jobs", "--json", cwd=tmp_path, env={"RELAY_JOBS_DIR": "jobs"})
    assert as_json.returncode == 2 and "does not exist" in as_json.stderr
    as_json = relay_cli("jobs", "--json", cwd=Path.cwd())
    echo = next(job for job in json.loads(as_json.stdout) if job["name"] == "echo")
    assert echo["params"]["message"] == {"type": "string", "required": True}
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


def test_run_exits_by_what_went_wrong(relay: RelayProcess) -> None:
    """Auth 3, not found 4, the relay unreachable 6 (relay --help lists them all)."""
    env = {"RELAY_URL": relay.url, "RELAY_TOKEN": "rly_wrong"}
    refused = relay_cli("run", "echo", "-p", "message=x", cwd=relay.root, env=env)
    assert refused.returncode == 3 and refused.stderr.startswith("error: ")
    assert "unknown token" not in refused.stderr  # an auth failure's body is never shown
    env["RELAY_TOKEN"] = relay.tokens["cli"]
    unknown = relay_cli("run", "nope", cwd=relay.root, env=env)
    assert unknown.returncode == 4 and "no job named" in unknown.stderr
    env["RELAY_URL"] = "http://127.0.0.1:9"
    down = relay_cli("run", "echo", "-p", "message=x", cwd=relay.root, env=env)
    assert down.returncode == 6 and "cannot reach" in down.stderr


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

    from testing.relay_server import REPO, free_port

    port = free_port()
    # As `make serve` runs it: .venv/bin/relay from the checkout, the venv not on PATH.
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "RELAY_PORT": str(port),
           "RELAY_JOBS_DIR": str(REPO / "jobs"), "RELAY_LOCAL_ROOT": str(tmp_path / "sbx")}  # fmt: skip
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        process = subprocess.Popen(
            [".venv/bin/relay", "serve", "--dev"], cwd=tmp_path, env=env,
            stdout=handle, stderr=subprocess.STDOUT, preexec_fn=tied_to_this_process(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with __import__("contextlib").suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            time.sleep(0.1)
        printed = out.read_text()
        assert "local provider isolation: bubblewrap" in printed
        assert '{"ts"' not in printed  # --dev logs read as text, not JSON
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
        console = re.search(r"The console: (http://\S+/console) ", printed)
        assert console is not None, printed
        assert httpx.get(console.group(1)).status_code == 200
        # The `relay run` line runs as printed, in the same shell, with nothing activated.
        run_line = next(x for x in printed.splitlines() if " run echo " in x).strip()
        ran = subprocess.run(["bash", "-c", run_line], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
        assert (ran.returncode, ran.stdout) == (0, "hi\n"), (run_line, ran.stderr)
        assert ".venv/bin/relay tokens new NAME --admin" in printed
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_the_printed_run_line_carries_the_auth_header(capsys: pytest.CaptureFixture[str]) -> None:
    """With RELAY_AUTH_HEADER=X-Api-Key, `relay run` pasted into another shell must send the
    token in that header too, and an IPv6 address is bracketed in the URL."""
    from relay.cli.serve import _print_howto
    from relay.settings import Settings

    settings = Settings(_env_file=None, auth_header="X-Api-Key", host="::1", port=8081)  # type: ignore[call-arg]
    _print_howto(settings, "rly_x")
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if " run echo " in x)
    assert "RELAY_URL=http://[::1]:8081 RELAY_TOKEN=rly_x RELAY_AUTH_HEADER=X-Api-Key " in line
    assert "-H 'X-Api-Key: rly_x'" in printed


def test_dev_mode_without_bubblewrap_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import relay.providers.local.invocation
    from relay.cli.serve import _dev_isolation
    from relay.settings import Settings

    monkeypatch.setattr(relay.providers.local.invocation, "bwrap_works", lambda: False)
    settings = _dev_isolation(Settings(_env_file=None))  # type: ignore[call-arg]
    assert settings.local_isolation == "none"
    assert "WITHOUT isolation" in capsys.readouterr().err
    explicit = Settings(_env_file=None, local_isolation="bwrap")  # type: ignore[call-arg]
    assert _dev_isolation(explicit).local_isolation == "bwrap"


def caller(relay: RelayProcess, name: str = "cli") -> dict[str, str]:
    return {"RELAY_URL": relay.url, "RELAY_TOKEN": relay.tokens[name]}


def hears_ctrl_c() -> None:
    """In the child before exec: SIGINT back to its default. A job started in the
    background (`make test &`, CI without a terminal) inherits SIGINT ignored, and Python
    then never raises KeyboardInterrupt: the child would not hear the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def started(relay: RelayProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "relay", *args],
        cwd=relay.root,
        env={"PATH": os.environ["PATH"], **caller(relay)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=hears_ctrl_c,
    )


@pytest.fixture
def ignoring_ctrl_c() -> Iterator[None]:
    """This process ignores SIGINT while the test runs, as one started in the background
    does: a child must hear Ctrl-C wherever the suite was started from."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def read_until(stream: IO[str] | None, wanted: str, timeout_s: float = 30) -> str:
    """What ``stream`` says until it holds ``wanted``, read from its descriptor (no
    buffer that select cannot see), never past the timeout."""
    assert stream is not None
    seen = ""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {wanted!r} within {timeout_s} s; saw {seen!r}"
        chunk = os.read(stream.fileno(), 4096)
        assert chunk, f"ended before {wanted!r}; saw {seen!r}"
        seen += chunk.decode()
    return seen


def stopped(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=30)


def test_run_prints_output_as_it_happens(relay: RelayProcess) -> None:
    process = started(relay, "run", "sleep", "-p", "seconds:=3")
    try:
        read_until(process.stdout, "sleeping")
        assert process.poll() is None  # the first line came while the job still runs
        out, err = process.communicate(timeout=30)
    finally:
        stopped(process)
    assert (process.returncode, out) == (0, "woke\n"), err


def test_run_sends_stdin_env_and_files_and_keeps_streams_apart(
    relay: RelayProcess, tmp_path: Path
) -> None:
    (tmp_path / "data.txt").write_text("from a file")
    snippet = (
        "import os, sys\n"
        "print(os.environ['GREETING'], open('in/data.txt').read())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "relay", "run", "python", "--stdin", "-", "--env",
         "GREETING=hi", "--file", f"{tmp_path / 'data.txt'}=in/data.txt"],
        input=snippet, cwd=relay.root, env={"PATH": os.environ["PATH"], **caller(relay)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (3, "hi from a file\n", "to stderr\n")


def test_exec_runs_a_raw_command(relay: RelayProcess) -> None:
    env = caller(relay, "ops")
    done = relay_cli("exec", "--", "sh", "-c", "echo raw; exit 4", cwd=relay.root, env=env)
    assert (done.returncode, done.stdout) == (4, "raw\n"), done.stderr
    bare = relay_cli("exec", "sh", cwd=relay.root, env=env)
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1 and "--" in bare.stderr


def test_no_wait_then_attach_and_the_runs_commands(relay: RelayProcess) -> None:
    env = caller(relay)
    accepted = relay_cli("run", "echo", "-p", "message=later", "--no-wait", cwd=relay.root, env=env)
    run_id = json.loads(accepted.stdout)["id"]
    attached = relay_cli("run", "--attach", run_id, cwd=relay.root, env=env)
    assert (attached.returncode, attached.stdout) == (0, "later\n"), attached.stderr
    listed = relay_cli("runs", "list", "--job", "echo", cwd=relay.root, env=env)
    header, *rows = listed.stdout.splitlines()
    assert listed.returncode == 0 and header.split() == list(COLUMNS)
    assert [run_id, "succeeded", "echo", "exit", "0"] in [row.split()[:5] for row in rows]
    shown = relay_cli("runs", "show", run_id, "--json", cwd=relay.root, env=env)
    assert json.loads(shown.stdout)["stdout"] == "later\n"
    told = relay_cli("runs", "show", run_id, cwd=relay.root, env=env).stdout
    assert told.startswith(f"{run_id}  succeeded  exit 0\n") and "job        echo" in told
    logs = relay_cli("runs", "logs", run_id, cwd=relay.root, env=env)
    assert logs.stdout == "later\n"
    finished = relay_cli("runs", "cancel", run_id, cwd=relay.root, env=env)
    assert finished.returncode == 2 and finished.stderr.count("\n") == 1
    missing = relay_cli("runs", "show", "run_nope", cwd=relay.root, env=env)
    assert missing.returncode == 4 and "relay runs list" in missing.stderr


def test_a_reader_that_went_away_is_no_traceback(relay: RelayProcess) -> None:
    """`relay runs show ID | head -1`: the pipe is closed before all is written. Every
    command stops quietly with SIGPIPE's exit code, as other tools do."""
    run_id = relay.post(relay.tokens["cli"], {"job": "echo", "params": {"message": "x"}}).json()
    for args in (
        ("runs", "show", run_id["id"]),
        ("runs", "list"),
        ("run", "echo", "-p", "message=x"),
    ):
        reader, writer = os.pipe()
        os.close(reader)  # so the first write fails with EPIPE
        try:
            done = subprocess.run(
                [sys.executable, "-m", "relay", *args],
                cwd=relay.root, env={"PATH": os.environ["PATH"], **caller(relay)},
                stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
            )  # fmt: skip
        finally:
            os.close(writer)
        assert (done.returncode, done.stderr) == (141, ""), (args, done.stderr)


def test_the_token_may_come_from_dot_env(relay: RelayProcess, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(f"RELAY_URL={relay.url}\nRELAY_TOKEN='{relay.tokens['cli']}'\n")
    done = relay_cli("run", "echo", "-p", "message=dotenv", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "dotenv\n"), done.stderr
    (tmp_path / ".env").unlink()
    missing = relay_cli("run", "echo", "-p", "message=x", cwd=tmp_path)
    assert missing.returncode == 2 and "RELAY_TOKEN" in missing.stderr
    assert "--no-auth-header" in missing.stderr and missing.stderr.count("\n") == 1
    exists = relay_cli("run", "echo", "--no-auth-header", cwd=tmp_path)
    assert exists.returncode != 0 and "unrecognized" not in exists.stderr


@pytest.mark.usefixtures("ignoring_ctrl_c")
def test_ctrl_c_says_how_to_follow_and_a_second_one_cancels(relay: RelayProcess) -> None:
    process = started(relay, "run", "sleep", "-p", "seconds:=30")
    try:
        read_until(process.stdout, "sleeping")
        process.send_signal(signal.SIGINT)
        said = read_until(process.stderr, "Ctrl-C again")
        run_id = re.search(r"run (run_\S+) is still going", said)
        assert run_id is not None and f"relay run --attach {run_id[1]}" in said
        assert f"relay runs cancel {run_id[1]}" in said
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 130
    finally:
        stopped(process)
    run = relay.wait_final(relay.tokens["cli"], run_id[1], timeout_s=30)
    assert run["state"] == "canceled"


@pytest.mark.usefixtures("ignoring_ctrl_c")
def test_one_ctrl_c_leaves_the_run_going(relay: RelayProcess) -> None:
    process = started(relay, "run", "sleep", "-p", "seconds:=30")
    try:
        read_until(process.stdout, "sleeping")
        process.send_signal(signal.SIGINT)
        said = read_until(process.stderr, "Ctrl-C again")
        assert process.wait(30) == 130
    finally:
        stopped(process)
    run_id = re.search(r"run (run_\S+) is still going", said)
    assert run_id is not None
    token = relay.tokens["cli"]
    assert relay.get(token, f"/v1/runs/{run_id[1]}").json()["state"] == "running"
    canceled = relay_cli("runs", "cancel", run_id[1], cwd=relay.root, env=caller(relay))
    assert canceled.returncode == 0 and f"canceled {run_id[1]}" in canceled.stdout


def test_errors_are_one_line_that_say_what_to_do(relay: RelayProcess) -> None:
    env = caller(relay)
    bad = relay_cli("run", "params", "-p", "name=n", "-p", "count:=abc", cwd=relay.root, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "param 'count'" in bad.stderr and "count:=3" in bad.stderr
    unknown = relay_cli("run", "nope", cwd=relay.root, env=env)
    assert unknown.returncode == 4 and "echo" in unknown.stderr
    assert "relay jobs reload" in unknown.stderr  # a job added since: how to load it
    # A refusal's body is never printed (a proxy's may quote a key): the status says what to check.
    scope = relay_cli("exec", "--", "true", cwd=relay.root, env=env)
    assert scope.returncode == 3 and scope.stderr.count("\n") == 1
    assert "HTTP 403" in scope.stderr and "relay tokens new NAME --command" in scope.stderr
    wrong = relay_cli("run", "echo", cwd=relay.root, env={**env, "RELAY_TOKEN": "rly_wrong"})
    assert "HTTP 401" in wrong.stderr and "check RELAY_TOKEN" in wrong.stderr
    probe = relay_cli("probe", "e2bb", cwd=relay.root, env=env)
    assert probe.returncode == 2 and probe.stderr.count("\n") == 1
    assert "no provider named 'e2bb'" in probe.stderr and "RELAY_PROVIDERS" not in probe.stderr
    for args in (["run", "--bogus"], ["runs", "lst"], ["tokens", "revoke"], ["nope"],
                 ["serve", "--port", "70000"], ["serve", "--port", "-1"]):  # fmt: skip
        wrong = relay_cli(*args, cwd=relay.root, env=env)
        assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, (args, wrong.stderr)
        assert wrong.stderr.startswith("error: ") and "--help" in wrong.stderr


def test_version_and_plain_help(tmp_path: Path) -> None:
    from relay import __version__

    assert relay_cli("--version", cwd=tmp_path).stdout == f"relay {__version__}\n"
    shown = relay_cli("--help", cwd=tmp_path).stdout
    assert "``" not in shown and "::" not in shown and "relay run echo" in shown


def test_every_option_says_what_it_does() -> None:
    """`--help` is the README's short form: no argument of any command is a bare name."""
    import argparse

    from relay.cli.arguments import parser
    from relay.client import arguments

    def walk(command: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from walk(child)
            elif action.help != argparse.SUPPRESS:
                yield command.prog, action

    every = [*walk(parser()), *walk(arguments()), *walk(arguments("relay exec", raw=True))]
    bare = [(prog, action.dest) for prog, action in every if not action.help]
    assert not bare, bare


def test_tokens_revoke_rotate_and_secret(relay: RelayProcess) -> None:
    relay.add_token("short-lived")
    relay.add_token("hooked", webhook_secret="s" * 64)  # as relay tokens made them before
    env = {"RELAY_TOKENS_FILE": str(relay.tokens_file)}
    secret = relay_cli("tokens", "secret", "hooked", cwd=relay.root, env=env)
    assert (secret.returncode, secret.stdout) == (0, "s" * 64 + "\n")
    none = relay_cli("tokens", "secret", "short-lived", cwd=relay.root, env=env)
    assert none.returncode == 2 and "RELAY_WEBHOOK_SECRET" in none.stderr
    assert "relay tokens secret short-lived --new" in none.stderr
    old = relay.tokens["short-lived"]
    rotated = relay_cli("tokens", "rotate", "short-lived", cwd=relay.root, env=env)
    new = rotated.stdout.strip()
    assert rotated.returncode == 0 and new.startswith("rly_") and new != old
    body = {"job": "echo", "params": {"message": "x"}}
    assert relay.post(old, body).status_code == 401
    assert relay.post(new, body).status_code == 200
    revoked = relay_cli("tokens", "revoke", "short-lived", cwd=relay.root, env=env)
    assert revoked.returncode == 0
    assert relay.post(new, body).status_code == 401
    assert relay.post(relay.tokens["cli"], body).status_code == 200  # the others stay
    again = relay_cli("tokens", "revoke", "short-lived", cwd=relay.root, env=env)
    assert again.returncode == 4 and "cli" in again.stderr and again.stderr.count("\n") == 1


def test_startup_problems_are_one_line_naming_the_setting(tmp_path: Path) -> None:
    relay_cli("tokens", "new", "a", cwd=tmp_path)
    (tmp_path / ".env").write_text("RELAY_LOG_LEVLE=debug\n")
    base = {"RELAY_JOBS_DIR": str(Path.cwd() / "jobs"), "RELAY_PROVIDRS": "x"}
    base["RELAY_PORT"] = str(free_port())
    # An enabled provider's own variables are settings too (its module's model): a typo in
    # one warns; a disabled provider's are let be.
    base |= {"RELAY_E2B_TEMPLATE": "base", "RELAY_E2B_API_KY": "x"}
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port another process holds
        cases = (
            ({"RELAY_PROVIDERS": "e2b"}, "RELAY_E2B_API_KEY"),
            ({"RELAY_TOKENS_FILE": str(tmp_path)}, "RELAY_TOKENS_FILE"),
            # A database that refuses connections (nothing listens on port 1): no traceback.
            ({"RELAY_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/db"}, "RELAY_DATABASE_URL"),
            ({"RELAY_DATABASE_URL": f"sqlite:///{tmp_path}/no/such/x.db"}, "RELAY_DATABASE_URL"),
            # A JSON setting that does not parse, a sandbox root that cannot be made, a cloud
            # provider without its key, a port another process holds, a host not here.
            ({"RELAY_POOL_WARM": "{echo: 2}"}, "RELAY_POOL_WARM"),
            ({"RELAY_COST_RATES": "e2b"}, "RELAY_COST_RATES"),
            # A misspelt job or rate would silently change nothing.
            ({"RELAY_POOL_WARM": '{"ehco": 1}'}, "RELAY_POOL_WARM: no job named 'ehco'"),
            ({"RELAY_COST_RATES": '{"e2b": {"vcpu": 1}}'}, "'vcpu' is not a rate"),
            ({"RELAY_LOCAL_ROOT": str(tmp_path / "tokens.toml" / "boxes")}, "RELAY_LOCAL_ROOT"),
            ({"RELAY_PROVIDERS": "local,modal"}, "RELAY_MODAL_TOKEN_ID"),
            ({"RELAY_PORT": str(taken.getsockname()[1])}, "RELAY_PORT"),
            ({"RELAY_HOST": "192.0.2.1"}, "RELAY_HOST"),  # TEST-NET-1: no interface has it
        )
        for setting, named in cases:
            done = relay_cli("serve", cwd=tmp_path, env={**base, **setting})
            errors = [line for line in done.stderr.splitlines() if not line.startswith("warning:")]
            assert done.returncode == 2 and len(errors) == 1, done.stderr
            assert errors[0].startswith("error: ") and named in errors[0]
            assert "Traceback" not in done.stderr + done.stdout
            assert "hunter2" not in done.stderr + done.stdout
            assert "RELAY_PROVIDRS (in the environment)" in done.stderr
            assert "did you mean RELAY_PROVIDERS?" in done.stderr
            assert "RELAY_LOG_LEVLE (in the .env) is not a relay setting" in done.stderr
            assert "RELAY_E2B_TEMPLATE" not in done.stderr
            e2b_enabled = setting.get("RELAY_PROVIDERS") == "e2b"
            assert ("did you mean RELAY_E2B_API_KEY?" in done.stderr) == e2b_enabled


def test_the_other_commands_name_the_setting_too(tmp_path: Path) -> None:
    """`relay tokens`, `reap` and `prune` reach the token file and the store as `serve` does:
    one line naming the setting, no traceback."""
    relay_cli("tokens", "new", "a", cwd=tmp_path)
    no_store = {"RELAY_DATABASE_URL": f"sqlite:///{tmp_path}/no/such/x.db"}
    for args, env, named in (
        (("tokens", "list"), no_store, "RELAY_DATABASE_URL"),
        (("reap", "--dry-run"), no_store, "RELAY_DATABASE_URL"),
        (("prune", "--dry-run"), no_store, "RELAY_DATABASE_URL"),
        (("tokens", "new", "b"), {"RELAY_TOKENS_FILE": str(tmp_path / "no" / "t.toml")},
         "RELAY_TOKENS_FILE"),
        (("tokens", "new", "b"), {"RELAY_TOKENS_FILE": str(tmp_path)}, "RELAY_TOKENS_FILE"),
    ):  # fmt: skip
        done = relay_cli(*args, cwd=tmp_path, env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args, done.stderr)
        assert done.stderr.startswith(f"error: {named}"), (args, done.stderr)
    # PostgreSQL named where its driver is not installed (shadowed here by one that fails).
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "asyncpg.py").write_text("raise ImportError('not installed')\n")
    no_driver = {"RELAY_DATABASE_URL": "postgresql://u@127.0.0.1:1/db",
                 "PYTHONPATH": str(tmp_path / "shadow"), "RELAY_PORT": str(free_port())}  # fmt: skip
    for command in ("tokens", "reap", "prune", "serve"):
        done = relay_cli(command, *(["list"] if command == "tokens" else []), cwd=tmp_path,
                         env=no_driver)  # fmt: skip
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (command, done.stderr)
        assert "asyncpg is not installed" in done.stderr, (command, done.stderr)
    (tmp_path / ".env").write_bytes("RELAY_CLUSTER=caf\u00e9\n".encode("latin-1"))
    done = relay_cli("jobs", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: .env: not UTF-8"), done.stderr


def test_serve_builds_each_provider_once(tmp_path: Path) -> None:
    """The providers `relay serve` checks before serving are the ones it serves with."""
    relay = RelayProcess(tmp_path, local_isolation="none")
    relay.add_token("a", jobs=["echo"])
    relay.start()
    try:
        assert relay.get(relay.tokens["a"], "/v1/providers").status_code == 200
    finally:
        relay.stop()
    assert relay.log().count("local provider without bubblewrap") == 1, relay.log()


def test_serve_on_a_full_disk_says_so(tmp_path: Path) -> None:
    """A SQLite file on a full disk: one line with SQLite's own reason, not a question
    about credentials."""
    from tests.runs.test_final_writes import small_tmpfs

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    relay_cli("tokens", "new", "a", cwd=tmp_path)
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as filler:
            while True:
                filler.write(b"\0" * 4096)
        env = {"RELAY_JOBS_DIR": str(Path.cwd() / "jobs"), "RELAY_PORT": "9",
               "RELAY_DATABASE_URL": f"sqlite:///{disk / 'relay.db'}"}  # fmt: skip
        done = relay_cli("serve", cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert "RELAY_DATABASE_URL" in done.stderr and "database or disk is full" in done.stderr
    assert "credentials" not in done.stderr and "Traceback" not in done.stderr


def test_serve_port_takes_exactly_what_relay_port_takes() -> None:
    """``--port``'s edges: 1 and 65535 are ports; 0 and 65536 (a socket wraps it) are not."""
    import argparse

    from relay.cli.arguments import _port

    assert (_port("1"), _port("65535")) == (1, 65535)
    for text in ("0", "65536", "8080.0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _port(text)


def test_exec_help_asks_for_a_command_not_a_job(relay: RelayProcess) -> None:
    shown = relay_cli("exec", "--help", cwd=relay.root).stdout
    assert shown.startswith("usage: relay exec [OPTIONS] -- ARGV...\n")
    assert "[job]" not in shown and "--param" not in shown and "--attach" not in shown
    assert "exit codes" in shown and "the run was canceled" in shown
    assert "[job]" in relay_cli("run", "--help", cwd=relay.root).stdout


def test_runs_list_names_what_a_raw_commands_run_ran(relay: RelayProcess) -> None:
    env = caller(relay, "ops")
    relay_cli("exec", "--", "sh", "-c", "echo listed", cwd=relay.root, env=env)
    listed = relay_cli("runs", "list", "--limit", "1", cwd=relay.root, env=env)
    header, row = listed.stdout.splitlines()
    what = row[header.index("JOB") : header.index("EXIT")].strip()
    assert what in ("$ sh -c echo listed", "(raw command)"), row  # its request, where listed


def test_runs_logs_follow_exits_as_relay_run_does(relay: RelayProcess) -> None:
    """A followed run that is canceled exits 7, as `relay run` does; one that fails, with
    the job's own code."""
    token = relay.tokens["cli"]
    run = relay.post(token, {"job": "sleep", "params": {"seconds": 30}, "wait": False}).json()
    process = started(relay, "runs", "logs", "-f", run["id"])
    try:
        read_until(process.stdout, "sleeping")
        assert relay.delete(token, f"/v1/runs/{run['id']}").status_code == 200
        _, err = process.communicate(timeout=30)
    finally:
        stopped(process)
    assert process.returncode == 7 and f"run {run['id']} canceled" in err, err
    attached = relay_cli("run", "--attach", run["id"], cwd=relay.root, env=caller(relay))
    assert attached.returncode == 7
    failed = relay_cli("exec", "--", "sh", "-c", "exit 5", cwd=relay.root, env=caller(relay, "ops"))
    assert failed.returncode == 5


def test_version_imports_nothing_heavy_and_is_quick(tmp_path: Path) -> None:
    """`relay --version` (and --help) builds the argument tree only: no settings, store,
    HTTP or provider module. Its CPU time is measured in a child process and printed; the
    bound is generous (the figure is ~0.08 s here, 0.65 s before the imports were lazy)."""
    code = (
        "import sys; import relay.cli.arguments as a; a.parser(); "
        "print(sorted(m for m in ('pydantic', 'sqlalchemy', 'starlette', 'relay.settings') "
        "if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)  # fmt: skip
    assert loaded.stdout == "[]\n", loaded.stdout
    figures = []
    for _ in range(3):
        before = os.times()
        started_at = time.monotonic()
        done = relay_cli("--version", cwd=tmp_path)
        after = os.times()
        cpu = (after.children_user - before.children_user) + (
            after.children_system - before.children_system
        )
        figures.append((cpu, time.monotonic() - started_at))
        assert done.returncode == 0
    cpu, wall = min(figures)
    print(f"relay --version: {cpu:.3f} s CPU, {wall:.3f} s wall (best of 3)")
    assert cpu <= 0.3, figures


def test_bash_completes_commands_actions_options_and_values(tmp_path: Path) -> None:
    script = relay_cli("completion", "bash", cwd=tmp_path)
    assert script.returncode == 0
    (tmp_path / "relay.bash").write_text(script.stdout)

    def completed(*words: str) -> list[str]:
        line = " ".join(f'"{word}"' for word in words)
        shell = (
            f"source {tmp_path / 'relay.bash'}; COMP_WORDS=(relay {line}); "
            f"COMP_CWORD={len(words)}; _relay; printf '%s\\n' \"${{COMPREPLY[@]}}\"; "
            "complete -p relay"
        )
        done = subprocess.run(["bash", "--norc", "-c", shell], capture_output=True, text=True,
                              timeout=30, check=True)  # fmt: skip
        *found, registered = done.stdout.splitlines()
        assert registered == "complete -F _relay relay"
        return sorted(found)

    assert completed("to") == ["tokens"]
    assert completed("r") == ["reap", "run", "runs"]
    assert completed("tokens", "") == ["list", "new", "revoke", "rotate", "secret"]
    assert completed("tokens", "rotate", "--") == ["--expires", "--help", "--overlap"]
    assert completed("runs", "list", "--j") == ["--job", "--json"]
    assert completed("run", "--att") == ["--attach", "--attempts"]
    assert "local" in completed("probe", "") and "memory" not in completed("probe", "")
    assert completed("completion", "") == ["bash", "fish", "zsh"]
    for shell in ("zsh", "fish"):
        assert "relay" in relay_cli("completion", shell, cwd=tmp_path).stdout


def test_serve_dev_with_no_jobs_says_so_instead_of_a_curl(tmp_path: Path) -> None:
    from testing.relay_server import free_port

    (tmp_path / "jobs").mkdir()
    env = {"RELAY_PORT": str(free_port()), "RELAY_LOCAL_ROOT": str(tmp_path / "sbx")}
    process = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--dev"], cwd=tmp_path,
        env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=tied_to_this_process(),
    )  # fmt: skip
    try:
        said = read_until(process.stdout, "The console")
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert "starting with no jobs" in said and "422 unknown_job" in said and "init" in said
    assert "curl" not in said and "run echo" not in said


def test_init_writes_jobs_a_dev_token_and_a_dot_env_and_keeps_them(tmp_path: Path) -> None:
    done = relay_cli("init", "here", cwd=tmp_path)
    assert done.returncode == 0 and "Next: cd here && relay serve --dev" in done.stdout
    here = tmp_path / "here"
    assert (here / "jobs" / "echo" / "job.toml").read_text() == (
        Path.cwd() / "jobs" / "echo" / "job.toml"
    ).read_text()
    dotenv = dict(
        line.split("=", 1) for line in (here / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )  # fmt: skip
    (dev,) = TokenStore(here / "tokens.toml").principals
    assert dev.name == "dev" and TokenStore(here / "tokens.toml").authenticate(
        dotenv["RELAY_TOKEN"]
    )
    assert (here / ".relay-dev-token").read_text().strip() == dotenv["RELAY_TOKEN"]
    assert dotenv["RELAY_URL"] == "http://127.0.0.1:8080"
    listed = relay_cli("jobs", cwd=here)  # the .env's paths: the folder works as it is
    assert listed.returncode == 0 and "5 job(s) valid" in listed.stderr
    before = (here / "tokens.toml").read_text()
    again = relay_cli("init", cwd=here)
    assert again.returncode == 0 and again.stdout.count("kept") == 3
    assert "Next: relay serve --dev" in again.stdout
    assert (here / "tokens.toml").read_text() == before


def test_a_runs_failed_attempts_are_one_line_each_in_run_and_runs_show() -> None:
    """The providers a route tried before the one that ran the job, each on a line of its
    own: `relay run` prints them on stderr, `relay runs show` under the provider."""
    from relay.cli.runs import _details
    from relay.client import failed_attempts

    run = {
        "id": "run_a",
        "state": "succeeded",
        "exit_code": 0,
        "provider": "daytona",
        "sandbox_id": "d-1",
        "attempts": [
            {"provider": "e2b", "sandbox_id": None, "error": {"code": "provider_timeout",
             "message": "E2B did not create the sandbox in time"}},
            {"provider": "daytona", "sandbox_id": "d-1", "error": None},
        ],
    }  # fmt: skip
    assert failed_attempts(run) == ["e2b: E2B did not create the sandbox in time"]
    assert "tried      e2b: E2B did not create the sandbox in time" in _details(run).splitlines()
    # A run that ended in error on the provider that ran it: that error is the run's own.
    lost = {**run, "state": "error", "attempts": [
        {"provider": "daytona", "sandbox_id": "d-1", "error": {"code": "sandbox_lost",
         "message": "gone"}},
    ]}  # fmt: skip
    assert failed_attempts(lost) == []
