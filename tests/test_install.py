"""The install: the distribution name, the licence that ships with it, and the lock file.

"relay" on the package index is an unrelated project, so the distribution is
``sandbox-relay`` (the import package and the ``relay`` command keep their name): no doc,
recipe or hint may tell anyone to ``pip install relay``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from testing.relay_server import free_port, tied_to_this_process
from tests.conftest import REPO

DISTRIBUTION = "sandbox-relay"
OLD_NAME = re.compile(
    # `relay[extra]` or `pip install relay` as a distribution, not a path (`./relay[all]`),
    # not the command (`relay serve`) and not part of a longer name (`sandbox-relay[all]`).
    r"(?<![\w/.-])relay\[|pip install (?:-\S+ )*['\"]?relay(?![\w/.-])"
)


def _texts() -> list[Path]:
    """Every file a person or the code reads an install command from."""
    found = [
        REPO / name
        for name in ("README.md", "CHANGELOG.md", "pyproject.toml", "Dockerfile", "Makefile")
    ]
    for folder, pattern in (("docs", "*.md"), ("deploy", "*"), ("relay", "*.py")):
        found += [
            path
            for path in (REPO / folder).rglob(pattern)
            # deploy/cloudflare's packages, installed by its tests, are not ours to read.
            if path.is_file() and "node_modules" not in path.parts
        ]
    return [path for path in found if path.exists()]


def test_the_distribution_is_sandbox_relay_and_the_command_relay() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    assert project["scripts"] == {"relay": "relay.cli:main"}
    extras = project["optional-dependencies"]
    items = [item for listed in extras.values() for item in listed]
    # The extras that gather others name the distribution as it is published (a tool's own
    # extras, such as moto's, are other distributions').
    assert any(item.startswith(f"{DISTRIBUTION}[") for item in items)
    assert not any(item.startswith("relay[") for item in items)


def test_no_doc_or_hint_names_the_old_distribution() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _texts()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OLD_NAME.search(line)
    ]
    assert not found, "\n".join(found)


def test_a_missing_sdk_names_the_distribution_to_install() -> None:
    source = (REPO / "relay" / "providers" / "registry.py").read_text()
    hints = re.findall(r"pip install [^\"]+", source)
    assert hints and all(hint.startswith(f"pip install '{DISTRIBUTION}") for hint in hints)


def test_the_mit_licence_ships_in_the_package_metadata() -> None:
    licence = (REPO / "LICENSE").read_text()
    assert licence.startswith("MIT License\n") and "WITHOUT WARRANTY OF ANY KIND" in licence
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    # The image builds the package from a copy of the files its metadata names.
    assert re.search(r"^COPY pyproject\.toml README\.md LICENSE \./$", _dockerfile(), re.M)


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


LOCK = REPO / "requirements" / "dev.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)$")


def _name(requirement: str) -> str:
    """The normalised project name of a requirement (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"not a name==version pin: {line!r}"
        pins[_name(match.group(1))] = match.group(2)
    return pins


def test_the_lock_pins_every_dependency_but_not_the_package() -> None:
    pins = _pins()
    assert DISTRIBUTION not in pins and "relay" not in pins
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for items in project["optional-dependencies"].values():
        wanted += [item for item in items if not item.startswith(DISTRIBUTION)]
    missing = {_name(item) for item in wanted} - set(pins)
    assert not missing, f"{sorted(missing)} not in {LOCK.name}: run `make lock`"


def test_make_test_and_ci_install_from_the_lock() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "LOCK   := requirements/dev.lock" in makefile
    installs = re.findall(r"^\t\$\(BIN\)/pip install .*$", makefile, re.M)
    assert installs and all("-c $(LOCK)" in line for line in installs), installs
    assert re.search(r"^\$\(VENV\)/\.dev: pyproject\.toml \$\(LOCK\)", makefile, re.M)
    assert re.search(r"^lock:$", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "pip install -c requirements/dev.lock -e '.[dev]'" in readme and "make lock" in readme


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from this checkout and installed in a fresh venv outside it (its
    dependencies from the test venv's site-packages, added by a .pth: offline and quick;
    the editable install's own path is not, so `relay` comes from the wheel alone)."""
    folder = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run([*build, "-w", str(folder / "dist"), str(REPO)], cwd=folder)
    (wheel,) = (folder / "dist").glob("sandbox_relay-*.whl")
    venv = folder / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=folder)
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         cwd=folder)  # fmt: skip
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    (site / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=180, check=False,
        env={"PATH": os.environ["PATH"], "HOME": str(cwd), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
             **env},
    )  # fmt: skip
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done


@pytest.mark.slow
def test_the_wheel_ships_types_urls_and_the_example_jobs(installed: Path) -> None:
    (site,) = (installed / "lib").glob("python3.*/site-packages")
    assert (site / "relay" / "py.typed").is_file()
    assert (site / "relay" / "examples" / "jobs" / "echo" / "job.toml").is_file()
    (metadata,) = site.glob("sandbox_relay-*.dist-info/METADATA")
    urls = [line for line in metadata.read_text().splitlines() if line.startswith("Project-URL")]
    assert {url.split(":")[1].split(",")[0].strip() for url in urls} >= {
        "Homepage", "Documentation", "Changelog"
    }  # fmt: skip


@pytest.mark.slow
def test_pip_install_then_relay_init_then_serve_and_run(installed: Path, tmp_path: Path) -> None:
    """As a user with no checkout: `relay init`, the command it prints, and a run."""
    relay = str(installed / "bin" / "relay")
    where = _run([relay, "--version"], cwd=tmp_path)
    assert where.stdout.startswith("relay ")
    found = _run([str(installed / "bin" / "python"), "-c", "import relay; print(relay.__file__)"],
                 cwd=tmp_path).stdout  # fmt: skip
    assert found.startswith(str(installed)), found  # the wheel's, not the checkout's
    told = _run([relay, "init", "app"], cwd=tmp_path).stdout
    app = tmp_path / "app"
    assert "Next: cd app && relay serve --dev" in told
    assert sorted(path.name for path in (app / "jobs").iterdir()) == [
        "chart", "echo", "http-status", "params", "python"
    ]  # fmt: skip
    assert stat.S_IMODE((app / ".env").stat().st_mode) == 0o600
    assert stat.S_IMODE((app / "tokens.toml").stat().st_mode) == 0o600
    port = str(free_port())
    env = {"PATH": f"{installed / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "RELAY_PORT": port, "RELAY_URL": f"http://127.0.0.1:{port}"}  # fmt: skip
    with (tmp_path / "serve.log").open("w") as log:
        server = subprocess.Popen(["relay", "serve", "--dev"], cwd=app, env=env, stdout=log,
                                  stderr=subprocess.STDOUT,
                                  preexec_fn=tied_to_this_process())  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        ran = subprocess.run(["relay", "run", "echo", "-p", "message=from a wheel"], cwd=app,
                             env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert (ran.returncode, ran.stdout) == (0, "from a wheel\n"), ran.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    again = _run([relay, "init", "app"], cwd=tmp_path).stdout
    assert "kept" in again and "wrote" not in again  # a second init overwrites nothing
