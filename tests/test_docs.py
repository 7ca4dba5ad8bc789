"""The README, .env.example and the OpenAPI document stay true to the code."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.cli import arguments
from relay.cli.serve import DEV_TOKEN_FILE
from relay.errors import ERROR_CLASSES
from relay.http.openapi import document
from relay.http.operator import operator_routes
from relay.http.routes import routes
from relay.providers.local.root import sandbox_root
from relay.providers.registry import PROVIDERS
from relay.runs.spool import RESERVE
from relay.settings import Settings
from relay.webhooks.dispatcher import signature_headers
from testing.relay_server import RelayProcess
from tests.conftest import REPO

CLIENT_VARIABLES = {"RELAY_URL", "RELAY_TOKEN"}
"""Read by `relay run` and relay/client.py on the caller's side, not by the server."""


def setting_names() -> set[str]:
    """The relay's settings and each provider's own (its module's settings model)."""
    names = {f"RELAY_{name.upper()}" for name in Settings.model_fields}
    for entry in PROVIDERS.values():
        module_name, class_name = entry.target.split(":")
        provider = getattr(importlib.import_module(module_name), class_name)
        model = provider.settings_model
        if model is not None:
            prefix = model.model_config["env_prefix"]
            names |= {f"{prefix}{field.upper()}" for field in model.model_fields}
    return names


def test_each_providers_settings_are_its_own() -> None:
    """A provider's keys are in its module's model, read under its own prefix."""
    names = setting_names()
    assert {"RELAY_E2B_API_KEY", "RELAY_MODAL_TOKEN_ID", "RELAY_VERCEL_TOKEN"} <= names
    assert not any(name.startswith(("e2b_", "modal_", "vercel_")) for name in Settings.model_fields)


def test_every_setting_is_in_env_example_and_readme() -> None:
    example = (REPO / ".env.example").read_text()
    readme = (REPO / "README.md").read_text()
    for name in setting_names():
        assert re.search(rf"^#? ?{name}=", example, re.M), f"{name} missing from .env.example"
        assert name in readme, f"{name} missing from README.md"
    documented = set(re.findall(r"RELAY_[A-Z0-9_]+(?==)", example))
    assert documented <= setting_names() | CLIENT_VARIABLES, documented - setting_names()


def test_every_variable_the_code_reads_is_documented() -> None:
    example = (REPO / ".env.example").read_text()
    named = set()
    for path in (REPO / "relay").rglob("*.py"):
        named |= set(re.findall(r"\bRELAY_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(n for n in named - {"RELAY_"} if not re.search(rf"^#? ?{n}=", example, re.M))
    assert not missing, f"named in relay/ but not in .env.example: {missing}"


def test_what_make_serve_leaves_in_a_checkout_is_ignored_by_git(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Quick start's `make serve` writes its token, store, spool (a 16 MiB reserve file)
    and sandboxes into the checkout: `git status` shows none of them, `git add -A` takes none."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    monkeypatch.chdir(REPO)
    settings = Settings(_env_file=None)
    made = [
        settings.tokens_file,
        DEV_TOKEN_FILE,
        Path("relay.db"),
        Path("relay.db-wal"),
        settings.state_directory() / "spool" / RESERVE,
        settings.state_directory() / "spool" / "run_1.json",
        sandbox_root(settings) / "lcl-1" / "lock",
    ]
    for path in made:
        relative = path.absolute().relative_to(REPO)
        done = subprocess.run(
            ["git", "check-ignore", "-q", "--no-index", str(relative)], cwd=REPO, check=False
        )
        assert done.returncode == 0, f"{relative} is not ignored by .gitignore"
    quick_start = (REPO / "README.md").read_text().split("## Quick start\n")[1].split("\n## ")[0]
    for name in ("relay.db", "spool/", "sandboxes/", "RELAY_PORT=8081 make serve"):
        assert f"`{name}`" in quick_start, f"the Quick start does not name {name}"


def test_relay_help_lists_the_readmes_exit_codes() -> None:
    """The README says `relay --help` lists the exit codes: each one of its table is there."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The `relay` command: for scripts and people\n")[1]
    table = section.split("| code | meaning |\n")[1].split("\n\n")[0]
    codes = re.findall(r"^\| (\d+) \|", table, re.M)
    assert len(codes) >= 10, table
    shown = arguments.parser().format_help().split("exit codes")[1]
    listed = re.findall(r"^\s+(\d+)  ", shown, re.M)
    assert sorted(codes, key=int) == sorted(listed, key=int), shown


def test_every_provider_is_named_where_a_newcomer_looks_for_a_probe() -> None:
    """`relay probe --help` and the Quick start's probe line name every provider it probes."""
    readme = (REPO / "README.md").read_text()
    line = readme.split("Trying a provider for the first time?")[1].split("\n\n")[0]
    shown = subprocess.run(
        [sys.executable, "-m", "relay", "probe", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    for name in PROVIDERS.keys() - {"memory"}:  # memory: the suite's fake, not probed
        assert f"`{name}`" in line or f"probe {name}`" in line, f"{name}: README's probe line"
        assert re.search(rf"\b{name}\b", shown), f"{name} missing from relay probe --help"


def test_readme_starts_with_the_two_commands() -> None:
    head = (REPO / "README.md").read_text().split("\n## ")[0]
    assert "make serve" in head and "make test" in head


def test_openapi_covers_every_route_and_error_code() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    for route in [*routes, *operator_routes]:
        path = re.sub(r":\w+\}", "}", route.path)  # {name:path} is {name} in the document
        for method in route.methods or ():
            if method == "HEAD":
                continue
            assert method.lower() in doc["paths"][path], (method, path)
    described = " ".join(
        answer["description"]
        for path in doc["paths"].values()
        for operation in path.values()
        for answer in operation["responses"].values()
    )
    for cls in ERROR_CLASSES:
        if cls.status >= 400 and cls.code != "internal":
            assert cls.code in described, cls.code


def test_the_webhook_is_described_as_the_dispatcher_sends_it() -> None:
    """``webhooks.runFinished`` names every header a delivery carries and the Run as its body,
    and the document says what the relay is (``/docs`` shows both)."""
    doc = document()
    assert "declared jobs" in doc["info"]["description"]
    finished = doc["webhooks"]["runFinished"]["post"]
    documented = {parameter["name"] for parameter in finished["parameters"]}
    sent = set(signature_headers("whsec_" + "A" * 43, "dlv_1", b"{}"))
    sent |= {"Relay-Run-Id", "Relay-Delivery-Id", "Relay-Delivery-Attempt"}
    assert documented == sent
    assert {"webhook-id", "webhook-timestamp", "webhook-signature"} <= documented
    body = finished["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/Run"}
    dispatcher = (REPO / "relay" / "webhooks" / "dispatcher.py").read_text()
    for header in sent - set(signature_headers("x", "dlv_1", b"{}")):
        assert f'"{header}":' in dispatcher, header


def test_the_readme_error_table_names_every_error_code() -> None:
    """A caller looks a code up in the README's table: each one the relay answers is there,
    on the row of its status."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("### Error codes\n\n")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        status, codes = line.split("|")[1:3]
        for code in re.findall(r"`(\w+)`", codes):
            rows[code] = status.strip()
    for cls in ERROR_CLASSES:
        assert cls.code in rows, f"{cls.code} ({cls.status}) missing from README's error codes"
        assert str(cls.status) in rows[cls.code], (cls.code, cls.status, rows[cls.code])


PLACEHOLDER = re.compile(r"<[a-z][a-z0-9-]*>")
"""How the README marks what a reader fills in (``<your-token>``, ``<run-id>``): such a
line is not run."""
NOT_RUN_HERE = ("make ", "git clone", "pip install", "cd deploy/cloudflare")
"""Blocks that install or serve (``make serve`` is tested by test_cli's dev-serve test, and
``pip install`` then ``relay init`` by test_install's wheel test), or deploy to a Cloudflare
account (the Worker's own code runs in tests/test_cloudflare_worker.py)."""


def shell_blocks() -> list[str]:
    readme = (REPO / "README.md").read_text()
    return re.findall(r"^```sh\n(.*?)^```", readme, re.S | re.M)


def runnable(block: str) -> str:
    """The block with its continued lines joined and placeholder lines left out."""
    lines = block.replace("\\\n", " ").splitlines()
    return "\n".join(line for line in lines if not PLACEHOLDER.search(line))


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("readme"), local_isolation="bwrap")
    server.add_token("dev", command=True)  # the README's exec line needs the command scope
    server.start()
    yield server
    server.stop()


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_every_readme_command_runs_as_written(relay: RelayProcess, tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / ".relay-dev-token").write_text(relay.tokens["dev"] + "\n")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copy(REPO / "relay" / "client.py", tmp_path / "client.py")
    env = {
        "PATH": f"{tmp_path / '.venv' / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "RELAY_URL": relay.url,
        "RELAY_TOKEN": relay.tokens["dev"],
        "RELAY_TOKENS_FILE": str(tmp_path / "tokens.toml"),  # the Tokens block's own file
        "RELAY_JOBS_DIR": str(REPO / "jobs"),  # the jobs a new token names are checked
    }
    ran = 0
    for block in shell_blocks():
        if block.startswith(NOT_RUN_HERE):
            continue
        script = runnable(block).replace("http://127.0.0.1:8080", relay.url)
        if not script.strip():
            continue
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{script}\n---\n{done.stdout}\n{done.stderr}"
        assert "error:" not in done.stderr, f"{script}\n---\n{done.stderr}"
        ran += script.count("\n") + 1
    assert ran >= 15


@pytest.mark.slow  # needs a relay process: seconds
def test_the_sample_answer_is_todays(relay: RelayProcess) -> None:
    readme = (REPO / "README.md").read_text()
    sample = readme.split("which answers with the finished run:\n\n```json\n")[1].split("```")[0]
    shown = json.loads(sample)
    body = {"job": "echo", "params": {"message": "hello from the relay"}}
    answer = relay.post(relay.tokens["dev"], body).json()
    assert list(shown) == list(answer)
    assert list(shown["timings"]) == list(answer["timings"])
    assert shown["stdout"] == answer["stdout"]
