"""A real relay (``python -m relay serve``) in a subprocess on a free loopback port."""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from relay.auth import new_token

REPO = Path(__file__).resolve().parent.parent
SECRET_CANARY = "canary-secret-7f3a9b2c"
"""Set as the relay's provider keys: it must never appear in an answer, a log or a job."""

TEST_JOBS = {
    "sleep": """
description = "Sleep for a while, then say so."
command = ["sh", "-c", "echo sleeping; sleep \\"$1\\"; echo woke", "sleep", "{seconds}"]
timeout_s = 120
allow = ["timeout_s"]
[params.seconds]
type = "integer"
required = true
min = 0
max = 600
""",
    "params": """
description = "Show how params arrive: argv, env and params.json."
command = ["python3", "-c", "import json,os,sys; print(json.dumps([sys.argv[1:], os.environ.get('FLAG'), json.load(open('params.json'))]))", "{name}", "--tags", "{tags}", "n={count}"]
params_file = true
[params.name]
type = "string"
required = true
max_length = 64
[params.tags]
type = "array"
max_items = 3
max_length = 10
pattern = "[a-z]+"
[params.count]
type = "integer"
min = 1
max = 10
default = 2
[params.flag]
type = "boolean"
env = "FLAG"
""",
}


START_TIMEOUT_S = 60.0
"""How long a start may take before it is a failure: a relay is up in ~1.5 s of CPU, but
the suite runs in parallel workers on a shared machine, where a start can wait long for a
core. Waiting is polling /healthz, so a long bound costs nothing when the start is quick."""


_PR_SET_PDEATHSIG, _SIGTERM = 1, int(signal.SIGTERM)
_prctl = ctypes.CDLL(None, use_errno=True).prctl
"""Looked up before any fork: a child only calls it."""


def tied_to_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` by which the child gets SIGTERM when the test process that starts
    it dies (``PR_SET_PDEATHSIG``), also when it is killed outright: a relay or server a
    killed run started does not live on with its runs, sandboxes and memory (it shuts down
    as on any SIGTERM). ``None`` outside the main thread: the kernel sends the signal when
    the starting *thread* ends."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def tie() -> None:
        _prctl(_PR_SET_PDEATHSIG, _SIGTERM)
        if os.getppid() != parent:  # it died before the tie was made
            os._exit(1)

    return tie


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RelayProcess:
    """Start, stop and kill a relay; read its log; call it with httpx."""

    def __init__(self, root: Path, **settings: Any) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.tokens_file = root / "tokens.toml"
        self.jobs_dir = root / "jobs"
        if not self.jobs_dir.exists():
            shutil.copytree(REPO / "jobs", self.jobs_dir)
            for name, manifest in TEST_JOBS.items():
                (self.jobs_dir / name).mkdir(exist_ok=True)
                (self.jobs_dir / name / "job.toml").write_text(manifest)
        self.tokens: dict[str, str] = {}
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root),
            "RELAY_PORT": str(self.port),
            "RELAY_TOKENS_FILE": str(self.tokens_file),
            "RELAY_JOBS_DIR": str(self.jobs_dir),
            "RELAY_DATABASE_URL": f"sqlite:///{root / 'relay.db'}",
            "RELAY_LOCAL_ROOT": str(root / "sandboxes"),
            "RELAY_CLUSTER": "e2e",
            "RELAY_LOG_FORMAT": "json",
            "RELAY_E2B_API_KEY": SECRET_CANARY,
            "RELAY_VERCEL_TOKEN": SECRET_CANARY,
        }
        self.env.update({f"RELAY_{k.upper()}": str(v) for k, v in settings.items()})
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = root / "relay.log"

    def add_token(self, name: str, **scopes: Any) -> str:
        token = new_token(self.tokens_file, name, **scopes)
        self.tokens[name] = token
        return token

    def start(
        self,
        timeout_s: float = START_TIMEOUT_S,
        *,
        open_files: int | None = None,
        attempts: int = 3,
    ) -> RelayProcess:
        """Start the relay and wait for /healthz; ``open_files``: its RLIMIT_NOFILE.

        A restart takes a fresh free port, as a restarted service behind a balancer may:
        the port a stopped relay held can be taken at once by any process on a busy machine
        (an outgoing connection's ephemeral port, another suite's server), and a free port
        can be taken between choosing and binding it, so a start that finds its port in use
        tries another (``attempts`` in all)."""
        for attempt in range(attempts):
            if self.starts or attempt:
                self._use_port(free_port())
            self.starts += 1
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                return self._start_once(timeout_s, open_files)
            except RuntimeError:
                with self.log_path.open("rb") as log:
                    log.seek(logged)
                    failed = log.read().decode(errors="replace")
                if "address already in use" not in failed or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env["RELAY_PORT"] = str(port)

    def _start_once(self, timeout_s: float, open_files: int | None) -> RelayProcess:
        tie = tied_to_this_process()

        def prepare() -> None:
            if tie is not None:
                tie()
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "relay", "serve"],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=prepare,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"relay exited at start:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"relay did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def headers(self, token: str | None, **extra: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **extra}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def post(
        self, token: str | None, body: Any, *, timeout: float = 60, **headers: str
    ) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/runs",
            json=body,
            headers=self.headers(token, **headers),
            timeout=timeout,
        )

    def get(self, token: str | None, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(token), params=params, timeout=30)

    def delete(self, token: str | None, path: str) -> httpx.Response:
        return httpx.delete(self.url + path, headers=self.headers(token), timeout=60)

    def wait_final(self, token: str, run_id: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run: dict[str, Any] = self.get(token, f"/v1/runs/{run_id}").json()
            if run["state"] in ("succeeded", "failed", "timed_out", "canceled", "error", "lost"):
                return run
            time.sleep(0.1)
        raise AssertionError(f"run {run_id} did not finish")
