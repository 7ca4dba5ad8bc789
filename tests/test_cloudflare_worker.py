"""The job Worker of deploy/cloudflare: its own tests, its types, and its deploy recipe.

The Worker's tests are TypeScript (vitest on ``@cloudflare/vitest-pool-workers``: workerd
from the npm registry, no Cloudflare account, no Docker; deploy/cloudflare/test). This
module runs them as part of ``make test``: ``npm ci`` from the committed lock when
node_modules is missing or was installed from another lock, then ``tsc`` (the Worker's
calls checked against the pinned SDK's types) and ``vitest run``. Node.js and npm come
from ``scripts/system-deps.sh``; without them these tests fail, they never skip.

The rest are static checks of the recipe: one sandbox class per instance type, bound and
migrated; the image at the SDK's version; the key a secret, never a var.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

WORKER = Path(__file__).resolve().parents[1] / "deploy" / "cloudflare"
LOCK = WORKER / "package-lock.json"
INSTALLED = WORKER / "node_modules" / ".relay-installed-lock"
"""The digest of the lock node_modules was installed from (inside it: gone with it)."""
INSTALL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 600
MIN_NODE = 20
INSTANCE_TYPES = ("lite", "basic", "standard-1", "standard-2", "standard-3", "standard-4")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: the job Worker's tests need Node.js and npm "
            "(`make system-deps` as root installs Debian's nodejs and npm)",
            pytrace=False,
        )
    return path


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv,
            cwd=WORKER,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "NO_COLOR": "1", "FORCE_COLOR": "0", "CI": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv[:3])} took over {timeout_s} s", pytrace=False)
        raise AssertionError from exc  # unreachable: pytest.fail raises


def _tail(done: subprocess.CompletedProcess[str], lines: int = 60) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """The Worker's packages, installed from the committed lock (``npm ci``) when needed."""
    version = _run([_tool("node"), "--version"], 30).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE:
        pytest.fail(
            f"node {version} is too old: the pinned wrangler needs {MIN_NODE}+", pytrace=False
        )
    npm = _tool("npm")
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    if not INSTALLED.is_file() or INSTALLED.read_text().strip() != digest:
        done = _run([npm, "ci", "--no-audit", "--no-fund"], INSTALL_TIMEOUT_S)
        assert done.returncode == 0, f"npm ci failed:\n{_tail(done)}"
        INSTALLED.write_text(digest + "\n")
    return WORKER / "node_modules"


@pytest.mark.node
@pytest.mark.timeout(INSTALL_TIMEOUT_S + RUN_TIMEOUT_S)
def test_the_worker_passes_its_own_tests_in_workerd(node_modules: Path) -> None:
    vitest = node_modules / ".bin" / "vitest"
    done = _run([str(vitest), "run", "--reporter=dot"], RUN_TIMEOUT_S)
    assert done.returncode == 0, f"the Worker's tests failed:\n{_tail(done)}"
    assert re.search(r"Tests\s+\d+ passed", _tail(done)), _tail(done)


@pytest.mark.node
@pytest.mark.timeout(INSTALL_TIMEOUT_S + RUN_TIMEOUT_S)
def test_the_worker_typechecks_against_the_pinned_sdk(node_modules: Path) -> None:
    done = _run([str(node_modules / ".bin" / "tsc"), "--noEmit", "-p", "."], RUN_TIMEOUT_S)
    assert done.returncode == 0, f"tsc found errors:\n{_tail(done)}"


# --- the deploy recipe ----------------------------------------------------------------------


def _wrangler() -> dict[str, Any]:
    """wrangler.jsonc as data (its // comments dropped; no string in it holds a //)."""
    text = (WORKER / "wrangler.jsonc").read_text()
    data = re.sub(r"^\s*//.*$|\s+//[^\"\n]*$", "", text, flags=re.MULTILINE)
    config: dict[str, Any] = json.loads(data)
    return config


def test_every_instance_type_has_a_sandbox_class_bound_and_migrated() -> None:
    config = _wrangler()
    types = {entry["instance_type"]: entry["class_name"] for entry in config["containers"]}
    assert sorted(types) == sorted(INSTANCE_TYPES)
    bindings = {b["name"]: b["class_name"] for b in config["durable_objects"]["bindings"]}
    migrated = {name for step in config["migrations"] for name in step["new_sqlite_classes"]}
    for class_name in types.values():
        assert bindings.get(class_name) == class_name
        assert class_name in migrated
    assert bindings["JOBS"] == "Job" and bindings["REGISTRY"] == "Registry"
    assert {"Job", "Registry"} <= migrated
    exported = (WORKER / "src" / "index.ts").read_text()
    for class_name in [*types.values(), "ContainerProxy"]:
        assert re.search(rf"\b{class_name}\b", exported), (
            f"src/index.ts does not export {class_name}"
        )


def test_the_instance_types_are_the_ones_the_contract_names() -> None:
    document = yaml.safe_load((WORKER / "openapi.yaml").read_text())
    job = document["components"]["schemas"]["Job"]
    assert tuple(job["properties"]["instance_type"]["enum"]) == INSTANCE_TYPES


def test_the_image_is_the_sandbox_image_of_the_pinned_sdk() -> None:
    package = json.loads((WORKER / "package.json").read_text())
    pinned = package["dependencies"]["@cloudflare/sandbox"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned), "pin the SDK to one version"
    locked = json.loads(LOCK.read_text())["packages"]["node_modules/@cloudflare/sandbox"]
    assert locked["version"] == pinned
    base = re.search(r"^FROM\s+(\S+)", (WORKER / "Dockerfile").read_text(), re.MULTILINE)
    assert base is not None and base.group(1) == f"docker.io/cloudflare/sandbox:{pinned}"
    for name, version in {**package["dependencies"], **package["devDependencies"]}.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name} is not pinned: {version}"


def test_the_key_is_a_secret_never_a_var() -> None:
    config = _wrangler()
    assert "JOB_WORKER_KEY" not in config.get("vars", {})
