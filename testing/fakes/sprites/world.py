"""The fake's state: sprites, their exec sessions, the ledger and the faults.

A sprite's filesystem is a private host directory standing in for ``/``; a command is a
real process run in it the way the Vercel fake runs one (:mod:`testing.fakes.vercel.jail`:
bubblewrap when it works here, path mapping otherwise). Sprites have no lifetime: one
lives until it is deleted, as on Fly. An exec session outlives its WebSocket (as the
SDK's session list and attach imply): frames not yet delivered wait for the next attach.
A command runs with the sprite's default environment (:meth:`World.default_env`), or,
when the exec names any ``env``, with exactly those variables: the docs say exec ``env``
*replaces* the default environment. Network policies: :mod:`testing.fakes.sprites.network`.
Everything runs on the fake's event loop; the ledger is also read from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from testing.fakes.sprites.network import Proxy, closed
from testing.fakes.vercel.jail import host_path, launch, prepare_root

STDOUT, STDERR, EXIT = 1, 2, 3
HOME = "/home/sprite"


@dataclass
class Faults:
    """Faults the next requests meet; ``reset()`` clears them all."""

    create_status: int | None = None
    """Every create answers this status (500, 429, 401...) without allocating."""
    create_hang: bool = False
    """Creates allocate the sprite, then never answer."""
    create_allocates_then_fails: bool = False
    """Creates allocate the sprite (alive, labelled), then answer 500."""
    create_delay_s: float | None = None
    """Creates allocate the sprite at once, then answer (201) only this much later: an
    answer that comes after the client gave up, for a sprite that exists."""
    policy_status: int | None = None
    """Network-policy calls answer this status (the sprite itself was created)."""
    cut_stream: bool = False
    """Exec WebSockets close (1011, no exit frame) after their first output frame."""
    terminate_failures: int = 0
    """The next N deletes answer 500."""
    vanish_after_s: float | None = None
    """Sprites created now are deleted by the fake this long after creation."""
    list_status: int | None = None
    """Listing sprites answers this status."""
    created_at_missing: bool = False
    """Sprite infos carry no ``created_at`` (optional to the SDK, which reads None then)."""

    def reset(self) -> None:
        fresh = Faults()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def take_terminate_failure(self) -> bool:
        if self.terminate_failures > 0:
            self.terminate_failures -= 1
            return True
        return False


@dataclass
class Ledger:
    """Ground truth: every create body, every delete, the sprites that exist now."""

    created: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[tuple[str, float]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    egress: list[tuple[str, str, bool]] = field(default_factory=list)
    """(sprite, host, allowed) for every request a sprite's proxy decided."""
    list_sizes: list[int] = field(default_factory=list)
    """The page size (``max_results``) of every list call, as asked."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _existing: set[str] = field(default_factory=set)

    def record_create(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.created.append(entry)
            self._existing.add(entry["name"])

    def mark_gone(self, name: str) -> None:
        with self.lock:
            if name in self._existing:
                self._existing.discard(name)
                self.deleted.append((name, time.time()))

    def alive(self) -> set[str]:
        """Sprites not deleted: a sprite is billed (storage at least) until then."""
        with self.lock:
            return set(self._existing)

    def create_of(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            return next((entry for entry in self.created if entry["name"] == name), None)

    def tags_of(self, name: str) -> dict[str, str]:
        entry = self.create_of(name)
        labels = [] if entry is None else entry["labels"]
        return dict(label.split("=", 1) for label in labels if "=" in label)

    def lifetime_of(self, name: str) -> float | None:
        """The lifetime the relay wrote in the labels: Fly has none to enforce it."""
        value = self.tags_of(name).get("relay-lifetime")
        return None if value is None else float(value)


class Signal:
    """An edge-triggered wake-up for a writer waiting on new frames."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()


@dataclass
class Session:
    """One exec: its process and the frames it produced (kept until delivered)."""

    id: str
    command: str
    workdir: str
    created: str
    process: asyncio.subprocess.Process | None = None
    frames: list[bytes] = field(default_factory=list)
    delivered: int = 0
    exit_code: int | None = None
    attached: bool = False
    lost: bool = False
    """The sprite was deleted under the command: its streams end without an exit."""
    changed: Signal = field(default_factory=Signal)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "command": self.command,
            "workdir": self.workdir,
            "created": self.created,
            "bytes_per_second": 0,
            "is_active": self.exit_code is None,
            "tty": False,
            "last_activity": self.created,
        }

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)


@dataclass
class FakeSprite:
    name: str
    root: Path
    labels: list[str]
    config: dict[str, Any]
    created_at: str
    policy: list[dict[str, Any]] = field(default_factory=list)
    sessions: dict[str, Session] = field(default_factory=dict)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    proxy: Proxy | None = None

    def info(self) -> dict[str, Any]:
        """What create and ``GET /v1/sprites/{name}`` answer (labels included)."""
        return {
            "id": f"sprite-{self.name}",
            "name": self.name,
            "organization": "fake-org",
            "status": "running" if self.sessions else "warm",
            "created_at": self.created_at,
            "updated_at": self.created_at,
            "labels": self.labels,
            "url": f"https://{self.name}.sprites.invalid",
            "url_settings": {"auth": "sprite"},
        }

    def listed(self) -> dict[str, Any]:
        """A list item: the documented ``{name, org_slug, updated_at}`` and nothing more
        (no labels, no ``created_at``: read those per sprite)."""
        return {"name": self.name, "org_slug": "fake-org", "updated_at": self.created_at}

    def host_path(self, path: str, cwd: str = "/") -> Path:
        return host_path(self.root, path, cwd)

    def isolated(self) -> bool:
        """Network off: no host can pass the policy (first match: a ``*`` deny first)."""
        return closed(self.policy)


class World:
    """All sprites the fake knows, by name."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self.base_dir = Path(tempfile.mkdtemp(prefix="fake-sprites-"))
        self.sprites: dict[str, FakeSprite] = {}
        self.hang = asyncio.Event()
        self.hosts: dict[str, tuple[str, int]] = {}
        """Host name → a local address: where the sprites' proxies reach an allowed host."""

    def default_env(self, sprite: FakeSprite, home: str) -> dict[str, str]:
        """A sprite's default environment: what a command gets when the exec names no env."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"}
        env["USER"] = "sprite"
        if sprite.proxy is not None:
            for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
                env[name] = sprite.proxy.url
        return env

    async def set_policy(self, sprite: FakeSprite, rules: list[dict[str, Any]]) -> None:
        """Apply a network policy; a sprite whose rules let some host through gets a proxy."""
        sprite.policy = rules
        if rules and not closed(rules) and sprite.proxy is None:
            ledger = self.ledger

            def record(host: str, allowed: bool) -> None:
                with ledger.lock:
                    ledger.egress.append((sprite.name, host, allowed))

            sprite.proxy = Proxy(lambda: sprite.policy, self.hosts, record)
            await sprite.proxy.start()

    def allocate(self, body: dict[str, Any]) -> FakeSprite:
        name = str(body["name"])
        root = self.base_dir / f"{name}-{secrets.token_hex(3)}"
        for directory in (HOME, "/tmp"):
            (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        prepare_root(root)
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        sprite = FakeSprite(
            name=name,
            root=root,
            labels=[str(label) for label in body.get("labels") or []],
            config=dict(body.get("config") or {}),
            created_at=now,
        )
        self.sprites[name] = sprite
        self.ledger.record_create(
            {"name": name, "labels": list(sprite.labels), "config": dict(sprite.config)}
        )
        if self.faults.vanish_after_s is not None:
            loop = asyncio.get_running_loop()
            sprite.timers.append(loop.call_later(self.faults.vanish_after_s, self.delete, name))
        return sprite

    def delete(self, name: str) -> bool:
        """Kill every process of the sprite and remove it; False if it did not exist."""
        sprite = self.sprites.pop(name, None)
        if sprite is None:
            return False
        for timer in sprite.timers:
            timer.cancel()
        if sprite.proxy is not None:
            sprite.proxy.close()
        for session in sprite.sessions.values():
            session.lost = True
            session.kill()
            session.changed.fire()
        shutil.rmtree(sprite.root, ignore_errors=True)
        self.ledger.mark_gone(name)
        return True

    async def start(
        self, sprite: FakeSprite, argv: list[str], env: dict[str, str], cwd: str
    ) -> Session:
        """Start ``argv`` as a real process in the sprite (exit 127 if it can't start)."""
        session = Session(
            id=str(len(self.ledger.commands) + 1),
            command=shlex.join(argv),
            workdir=cwd,
            created=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        )
        sprite.sessions[session.id] = session
        with self.ledger.lock:
            self.ledger.commands.append(
                {"sprite": sprite.name, "argv": argv, "cwd": cwd, "env_names": sorted(env)}
            )
        how = launch(sprite.root, argv, cwd, isolate_network=sprite.isolated())
        home = HOME if how.cwd is None else str(sprite.host_path(HOME))
        # The docs: an exec's env *replaces* the default environment (HOME, PATH gone).
        process_env = dict(env) if env else self.default_env(sprite, home)
        try:
            session.process = await asyncio.create_subprocess_exec(
                *how.argv,
                cwd=how.cwd,
                env=process_env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            session.frames.append(bytes([STDERR]) + f"{argv[0]}: {exc.strerror}\n".encode())
            session.exit_code = 127
            return session
        session.tasks.append(asyncio.create_task(_follow(session)))
        return session

    async def shutdown(self) -> None:
        """Kill every process and remove every sprite (the fake is going away)."""
        self.hang.set()
        for name in list(self.sprites):
            sprite = self.sprites[name]
            sessions = list(sprite.sessions.values())
            self.delete(name)
            if sprite.proxy is not None:
                await sprite.proxy.wait_closed()
            for session in sessions:
                if session.process is not None:
                    await session.process.wait()
                await asyncio.gather(*session.tasks, return_exceptions=True)
        shutil.rmtree(self.base_dir, ignore_errors=True)


async def _follow(session: Session) -> None:
    process = session.process
    assert process is not None
    pumps = [
        asyncio.create_task(_pump(session, process.stdout, STDOUT)),
        asyncio.create_task(_pump(session, process.stderr, STDERR)),
    ]
    try:
        code = await process.wait()
        await asyncio.wait(pumps, timeout=1.0)
    finally:
        session.kill()
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    session.exit_code = code if code >= 0 else 128 - code
    session.changed.fire()


async def _pump(session: Session, stream: asyncio.StreamReader | None, stream_id: int) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        session.frames.append(bytes([stream_id]) + chunk)
        session.changed.fire()
