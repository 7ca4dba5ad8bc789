"""Attacks through the request itself, against a real relay with bubblewrap.

A request may not replace what the job owns (its files, ``params.json``, its variables,
the relay's own marker), a param may not become an option, hostile shapes are 4xx JSON
errors and never ``internal``, the token file never fails open, and the dev token cannot
run raw commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.auth import TokenStore, new_token
from relay.cli.serve import DEV_TOKEN_FILE, _dev_setup
from testing.relay_server import RelayProcess
from tests.conftest import make_settings

JOBS = {
    # A job with its own script, params.json, a variable from a param and one of its own.
    "owned": """
command = ["python3", "-I", "run.py"]
files = ["run.py"]
params_file = true
env = { MODE = "safe" }
allow = ["files", "env", "workdir"]
[params.level]
type = "integer"
max = 9
default = 1
env = "LEVEL"
""",
    # Params that become whole argv elements; only `flag` may start with a dash.
    "dashes": """
command = ["printf", "%s|", "{words}", "{word}", "{flag}"]
[params.words]
type = "array"
max_items = 4
max_length = 20
[params.word]
type = "string"
max_length = 20
[params.flag]
type = "string"
max_length = 20
allow_leading_dash = true
""",
}
OWNED_SCRIPT = (
    "import json, os\n"
    "print(json.dumps([os.environ['MODE'], os.environ['LEVEL'], json.load(open('params.json')),"
    " sorted(os.listdir('.'))]))\n"
)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("attack-requests"), local_isolation="bwrap")
    for name, manifest in JOBS.items():
        (server.jobs_dir / name).mkdir()
        (server.jobs_dir / name / "job.toml").write_text(manifest)
    (server.jobs_dir / "owned" / "run.py").write_text(OWNED_SCRIPT)
    server.add_token("ops", command=True)
    server.add_token("files-only", jobs=["owned", "python", "echo", "dashes"])
    server.start()
    yield server
    server.stop()


def refused(relay: RelayProcess, body: Any, status: int, code: str, who: str = "ops") -> str:
    """Send ``body`` (bytes as they are); it must be refused with ``code`` and no run."""
    token = relay.tokens[who]
    before = len(relay.get(token, "/v1/runs", limit=200).json()["runs"])
    if isinstance(body, bytes):
        answer = httpx.post(
            relay.url + "/v1/runs", content=body, headers=relay.headers(token), timeout=30
        )
    else:
        answer = relay.post(token, body)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == code, error
    after = len(relay.get(token, "/v1/runs", limit=200).json()["runs"])
    assert after == before, "a refused request must not create a run"
    message: str = error["message"]
    return message


# --- item 6: the job's files and variables always win --------------------------------


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(
    "path", ["run.py", "./run.py", "a/../run.py", "run.py/x", "params.json", "./params.json"]
)
def test_a_request_file_cannot_replace_the_jobs_own(relay: RelayProcess, path: str) -> None:
    body = {"job": "owned", "files": {path: "print('replaced')"}}
    message = refused(relay, body, 422, "file_conflict", who="files-only")
    assert "run.py" in message or "params.json" in message


@pytest.mark.slow  # needs a relay process: seconds
def test_python_jobs_params_json_cannot_be_replaced(relay: RelayProcess) -> None:
    body = {
        "job": "python",
        "params": {"label": "real"},
        "stdin": "print(open('params.json').read())",
        "files": {"params.json": '{"label": "$(reboot)"}'},
    }
    refused(relay, body, 422, "file_conflict", who="files-only")


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize("name", ["LEVEL", "MODE", "SANDBOX_ID"])
def test_a_request_variable_cannot_replace_the_jobs_or_the_relays(
    relay: RelayProcess, name: str
) -> None:
    refused(relay, {"job": "owned", "env": {name: "x"}}, 422, "env_conflict", who="files-only")


@pytest.mark.slow  # needs a relay process: seconds
def test_a_raw_command_cannot_set_the_relays_marker(relay: RelayProcess) -> None:
    refused(relay, {"command": ["env"], "env": {"SANDBOX_ID": "lcl-other"}}, 422, "env_conflict")


@pytest.mark.slow  # needs a relay process: seconds
def test_files_and_variables_beside_the_jobs_own_are_fine(relay: RelayProcess) -> None:
    body = {
        "job": "owned",
        "params": {"level": 3},
        "files": {"extra.txt": "x", "sub/more.txt": "y"},
        "env": {"OTHER": "1"},
    }
    run = relay.post(relay.tokens["files-only"], body).json()
    assert run["state"] == "succeeded", run
    mode, level, params, listing = json.loads(run["stdout"])
    assert (mode, level, params) == ("safe", "3", {"level": 3})
    assert listing == ["extra.txt", "params.json", "run.py", "sub"]


@pytest.mark.slow  # needs a relay process: seconds
def test_a_workdir_cannot_be_one_of_the_files(relay: RelayProcess) -> None:
    refused(relay, {"job": "owned", "workdir": "run.py"}, 422, "validation_error", "files-only")
    body = {"command": ["pwd"], "files": {"w": "x"}, "workdir": "w/deeper"}
    refused(relay, body, 422, "validation_error")


# --- item 7: a param never becomes an option -----------------------------------------


@pytest.mark.slow  # needs a relay process: seconds
def test_echo_does_not_print_its_version(relay: RelayProcess) -> None:
    body = {"job": "echo", "params": {"message": "--version"}}
    assert "starts with '-'" in refused(relay, body, 422, "invalid_params", who="files-only")


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(
    "params", [{"words": ["ok", "--help"]}, {"words": ["-n"]}, {"word": "-e"}, {"word": "-"}]
)
def test_dashed_values_are_refused_item_by_item(
    relay: RelayProcess, params: dict[str, Any]
) -> None:
    refused(relay, {"job": "dashes", "params": params}, 422, "invalid_params", who="files-only")


@pytest.mark.slow  # needs a relay process: seconds
def test_a_param_that_allows_a_leading_dash_gets_it(relay: RelayProcess) -> None:
    body = {"job": "dashes", "params": {"words": ["a", "b-c"], "word": "x-", "flag": "-n"}}
    run = relay.post(relay.tokens["files-only"], body).json()
    assert run["state"] == "succeeded" and run["stdout"] == "a|b-c|x-|-n|", run


# --- item 12: hostile shapes are 4xx JSON errors, never internal ---------------------


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


HOSTILE: list[tuple[str, bytes, int, str]] = [
    ("1000-deep JSON", b'{"command": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "invalid_request"),
    (
        "100-deep params",
        b'{"job": "echo", "params": ' + b'{"a":' * 100 + b"1" + b"}" * 101,
        400,
        "invalid_request",
    ),
    (
        "5000-digit number",
        b'{"command": ["true"], "timeout_s": 1' + b"0" * 5000 + b"}",
        400,
        "invalid_json",
    ),
    (
        "NUL in a file path",
        _json({"command": ["true"], "files": {"a\0b": "x"}}),
        422,
        "validation_error",
    ),
    ("NUL in argv", _json({"command": ["echo", "a\0b"]}), 422, "validation_error"),
    ("NUL in argv[0]", _json({"command": ["ec\0ho"]}), 422, "validation_error"),
    (
        "NUL in an env value",
        _json({"command": ["true"], "env": {"A": "a\0b"}}),
        422,
        "validation_error",
    ),
    (
        "NUL in an env name",
        _json({"command": ["true"], "env": {"A\0B": "x"}}),
        422,
        "validation_error",
    ),
    (
        "NUL in the workdir",
        _json({"command": ["true"], "workdir": "a\0b"}),
        422,
        "validation_error",
    ),
    ("NUL in the image", _json({"command": ["true"], "image": "a\0b"}), 422, "validation_error"),
    ("a file named .", _json({"command": ["true"], "files": {".": "x"}}), 422, "validation_error"),
    (
        "a file named a/..",
        _json({"command": ["true"], "files": {"a/..": "x"}}),
        422,
        "validation_error",
    ),
    (
        "a 300-character name",
        _json({"command": ["true"], "files": {"a" * 300: "x"}}),
        422,
        "validation_error",
    ),
    (
        "a 2000-deep path",
        _json({"command": ["true"], "files": {"a/" * 2000 + "f": "x"}}),
        422,
        "validation_error",
    ),
    (
        "a 40-deep short path",
        _json({"command": ["true"], "files": {"a/" * 40 + "f": "x"}}),
        422,
        "validation_error",
    ),
    (
        "a 5000-byte path",
        _json({"command": ["true"], "files": {("b" * 200 + "/") * 25 + "f": "x"}}),
        422,
        "validation_error",
    ),
    (
        "a 300-character workdir name",
        _json({"command": ["true"], "workdir": "w" * 300}),
        422,
        "validation_error",
    ),
    (
        "a file and its folder",
        _json({"command": ["true"], "files": {"a": "x", "a/b": "y"}}),
        422,
        "validation_error",
    ),
    (
        "one file twice",
        _json({"command": ["true"], "files": {"a": "x", "./a": "y"}}),
        422,
        "validation_error",
    ),
    (
        "a workdir that is a file",
        _json({"command": ["true"], "files": {"w": "x"}, "workdir": "w"}),
        422,
        "validation_error",
    ),
    ("a lone surrogate", b'{"command": ["echo", "\\ud800"]}', 422, "validation_error"),
    (
        "a lone surrogate in a path",
        b'{"command": ["true"], "files": {"\\udc80": "x"}}',
        422,
        "validation_error",
    ),
    (
        "an escaping path",
        _json({"command": ["true"], "files": {"a/../../x": "y"}}),
        422,
        "validation_error",
    ),
    (
        "an absolute workdir",
        _json({"command": ["true"], "workdir": "//etc"}),
        422,
        "validation_error",
    ),
]


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(("name", "body", "status", "code"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_shapes_are_refused_as_json(
    relay: RelayProcess, name: str, body: bytes, status: int, code: str
) -> None:
    refused(relay, body, status, code)


@pytest.mark.slow  # needs a relay process: seconds
def test_a_nul_in_stdin_is_only_data(relay: RelayProcess) -> None:
    run = relay.post(relay.tokens["ops"], {"command": ["cat"], "stdin": "a\0b"}).json()
    assert run["state"] == "succeeded" and run["stdout"] == "a\0b"


# --- item 10: the dev token runs declared jobs only ----------------------------------


def test_the_dev_token_cannot_run_a_raw_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # `relay serve --dev` keeps .relay-dev-token in the cwd
    settings = make_settings(tmp_path)
    token = _dev_setup(settings)
    assert token is not None and (tmp_path / DEV_TOKEN_FILE).read_text().strip() == token
    principal = TokenStore(settings.tokens_file).authenticate(token)
    assert principal.name == "dev" and not principal.command
    assert principal.may_run_job("echo")


# --- item 11: the token file never fails open ----------------------------------------


@pytest.fixture
def token_relay(tmp_path: Path) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path / "relay", local_isolation="bwrap")
    server.add_token("ci", jobs=["echo"])
    server.start()
    yield server
    server.stop()


ECHO = {"job": "echo", "params": {"message": "hi"}}


def _settle(relay: RelayProcess) -> httpx.Response:
    # The file is re-read when it changes; give the filesystem's clock a tick.
    time.sleep(0.05)
    return relay.get(None, "/readyz")


@pytest.mark.slow  # needs a relay process: seconds
def test_a_deleted_token_file_revokes_every_token(token_relay: RelayProcess) -> None:
    token = token_relay.tokens["ci"]
    assert token_relay.post(token, ECHO).status_code == 200
    saved = token_relay.tokens_file.read_bytes()
    token_relay.tokens_file.unlink()
    ready = _settle(token_relay)
    assert ready.status_code == 503 and "revoked" in ready.json()["checks"]["tokens"]
    answer = token_relay.post(token, ECHO)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"
    assert "token file" in token_relay.log() and '"level": "error"' in token_relay.log()
    token_relay.tokens_file.write_bytes(saved)
    assert _settle(token_relay).status_code == 200
    assert token_relay.post(token, ECHO).status_code == 200


@pytest.mark.slow  # needs a relay process: seconds
def test_an_invalid_token_file_keeps_the_last_good_tokens_and_says_so(
    token_relay: RelayProcess,
) -> None:
    token = token_relay.tokens["ci"]
    good = token_relay.tokens_file.read_text()
    token_relay.tokens_file.write_text(good + "\n[tokens.half\n")
    ready = _settle(token_relay)
    assert ready.status_code == 503 and "last good" in ready.json()["checks"]["tokens"]
    assert token_relay.post(token, ECHO).status_code == 200
    assert "not valid TOML" in token_relay.log()


@pytest.mark.slow  # needs a relay process: seconds
def test_a_typo_key_on_reload_is_refused_not_widened(token_relay: RelayProcess) -> None:
    token = token_relay.tokens["ci"]
    typo = new_token(token_relay.tokens_file, "typo")
    text = token_relay.tokens_file.read_text()
    head, tail = text.split("[tokens.typo]")
    token_relay.tokens_file.write_text(head + "[tokens.typo]" + tail.replace("jobs =", "job ="))
    ready = _settle(token_relay)
    assert ready.status_code == 503, ready.text
    assert token_relay.post(typo, ECHO).status_code == 401
    assert token_relay.post(token, ECHO).status_code == 200
    assert "did you mean 'jobs'" in token_relay.log()


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (("jobs =", "job ="), "tokens.ci.job: unknown key (did you mean 'jobs'?)"),
        (("command =", "max_timout_s = 5\ncommand ="), "max_timout_s: unknown key"),
        (("[tokens.ci]", "[tokens.ci"), "not valid TOML"),
    ],
)
def test_an_invalid_token_file_stops_startup_in_one_line(
    tmp_path: Path, edit: tuple[str, str], named: str
) -> None:
    server = RelayProcess(tmp_path / "relay")
    server.add_token("ci", jobs=["echo"])
    text = server.tokens_file.read_text()
    server.tokens_file.write_text(text.replace(*edit))
    done = subprocess.run(
        [sys.executable, "-m", "relay", "serve"],
        cwd=server.root,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], done.stderr
