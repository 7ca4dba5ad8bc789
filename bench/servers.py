"""The servers under test: a real relay (``python -m relay serve``), the bare baseline and
the stack's floor.

The relay is started by :class:`testing.relay_server.RelayProcess` (the same harness the
end-to-end tests use: a temp token file, jobs folder and SQLite file), with the memory
provider enabled and two bench jobs added to its catalog.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from testing.relay_server import REPO, RelayProcess, free_port, tied_to_this_process

BENCH_JOBS = {
    "noop": """
description = "Benchmark: return at once on the zero-latency memory provider."
command = ["true"]
provider = "memory"
timeout_s = 30
""",
    "wait": """
description = "Benchmark: hold a run for a while on the memory provider (no process)."
command = ["sleep", "{seconds}"]
provider = "memory"
timeout_s = 120
[params.seconds]
type = "integer"
required = true
min = 0
max = 100
""",
}

RELAY_SETTINGS: dict[str, object] = {
    "providers": "local,memory",  # local first: the echo job runs on it; bench jobs name memory
    # Let 1,000 runs wait at once: no run-count limit and a long enough wait.
    "max_concurrent": 100_000,
    "max_wait_s": 120,
    "log_level": "info",
}


def raise_open_files() -> int:
    """Lift this process's soft open-file limit to the hard one; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@contextlib.contextmanager
def relay(root: Path, **settings: object) -> Iterator[tuple[RelayProcess, str]]:
    """A running relay and a token that may run the bench jobs and the echo job."""
    server = RelayProcess(root, **{**RELAY_SETTINGS, **settings})
    for name, manifest in BENCH_JOBS.items():
        (server.jobs_dir / name).mkdir()
        (server.jobs_dir / name / "job.toml").write_text(manifest)
    token = server.add_token("bench")
    server.start(timeout_s=30)
    try:
        yield server, token
    finally:
        server.stop()


def baseline() -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], str]]:
    """The bare Starlette endpoint (bench/baseline.py) on a free loopback port."""
    return _server("bench.baseline")


def floor(
    root: Path, token: str, database_url: str | None = None, *, plain: bool = False
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], str]]:
    """The stack's floor (bench/floor.py), taking ``token``: its SQLite file in ``root``, or
    the database at ``database_url``; ``plain``: served on uvicorn's defaults."""
    root.mkdir(parents=True, exist_ok=True)
    extra = ("plain",) if plain else ()
    return _server("bench.floor", database_url or str(root / "floor.db"), token, *extra)


@contextlib.contextmanager
def _server(module: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(port), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=tied_to_this_process(),
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited: {process.stderr!r}")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{module} did not start") from None
                time.sleep(0.1)
        yield process, url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
