"""The fake's state: named sandboxes, sessions, the ledger and the faults.

Everything here runs on the fake's event loop; the ledger is the only part read from
other threads.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from pathlib import Path
from typing import Any

from testing.fakes.vercel.jail import prepare_root
from testing.fakes.vercel.ledger import Faults, Ledger
from testing.fakes.vercel.sandboxes import DEFAULT_CWD, FakeSandbox

DEFAULT_TIMEOUT_MS = 300_000


class World:
    """All sandboxes the fake knows, by name and by session id."""

    def __init__(self, base_dir: Path | None = None) -> None:
        self.ledger = Ledger()
        self.faults = Faults()
        self._own_dir = base_dir is None
        self.base_dir = base_dir or Path(tempfile.mkdtemp(prefix="fake-vercel-"))
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.hang = asyncio.Event()

    def by_session(self, session_id: str) -> FakeSandbox | None:
        for box in self.sandboxes.values():
            if box.session_id == session_id:
                return box
        return None

    def allocate(self, body: dict[str, Any], team_id: str | None) -> FakeSandbox:
        """Create a running sandbox from a create body; record it; arm its timers."""
        name = body.get("name") or f"sbx-{secrets.token_hex(6)}"
        timeout_ms = int(body.get("timeout") or DEFAULT_TIMEOUT_MS)
        resources = body.get("resources") or {}
        vcpus = int(resources.get("vcpus") or 2)
        root = self.base_dir / f"{name}-{secrets.token_hex(3)}"
        for directory in (DEFAULT_CWD, "/tmp"):
            (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        prepare_root(root)
        box = FakeSandbox(
            name=name,
            project_id=str(body.get("projectId", "")),
            session_id=f"sess_{secrets.token_hex(8)}",
            root=root,
            timeout_ms=timeout_ms,
            tags=dict(body.get("tags") or {}),
            env=dict(body.get("env") or {}),
            image=body.get("image"),
            vcpus=vcpus,
            network_policy=body.get("networkPolicy"),
            persistent=body.get("persistent"),
        )
        self.sandboxes[name] = box
        self.ledger.record_create(
            {
                "name": name,
                "project_id": box.project_id,
                "team_id": team_id,
                "image": box.image,
                "timeout_ms": timeout_ms,
                "lifetime_s": timeout_ms / 1000,
                "tags": dict(box.tags),
                "network_policy": box.network_policy,
                "resources": dict(resources),
                "env_names": sorted(box.env),
                "persistent": box.persistent,
            }
        )
        self.ledger.mark_running(name)
        loop = asyncio.get_running_loop()
        # The provider-side hard deadline: the session stops when its timeout passes.
        box.timers.append(loop.call_later(timeout_ms / 1000, self.stop, name, "stopped"))
        if self.faults.vanish_after_s is not None:
            box.timers.append(loop.call_later(self.faults.vanish_after_s, self.vanish, name))
        if self.faults.stop_after_s is not None:
            box.timers.append(loop.call_later(self.faults.stop_after_s, self.stop, name, "stopped"))
        return box

    def stop(self, name: str, reason: str = "stopped") -> None:
        box = self.sandboxes.get(name)
        if box is None:
            return
        box.stop(reason)
        self.ledger.mark_stopped(name)

    def destroy(self, name: str) -> FakeSandbox | None:
        box = self.sandboxes.pop(name, None)
        if box is None:
            return None
        box.stop("vanished")
        box.remove_files()
        self.ledger.mark_gone(name)
        return box

    def vanish(self, name: str) -> None:
        """The sandbox disappears under its user: killed, and later calls answer 404."""
        self.destroy(name)

    async def shutdown(self) -> None:
        """Kill every process and remove every sandbox (the fake is going away)."""
        self.hang.set()
        for name in list(self.sandboxes):
            box = self.sandboxes[name]
            box.stop("vanished")
            for command in box.commands.values():
                if command.process is not None:
                    await command.process.wait()
                for task in command.tasks:
                    task.cancel()
                await asyncio.gather(*command.tasks, return_exceptions=True)
            self.destroy(name)
        if self._own_dir:
            import shutil

            shutil.rmtree(self.base_dir, ignore_errors=True)
