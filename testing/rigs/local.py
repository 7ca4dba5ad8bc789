"""The local rig: sandboxes on this machine, under bubblewrap (or, as variant ``none``, a bare
process group), their ground truth the sandbox root's folders and the processes marked as
theirs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from relay.providers.local.root import marked_pids
from testing.rigs.rig import Rig

if TYPE_CHECKING:
    from typing import Self


class LocalRig(Rig):
    """The local provider on a sandbox root of the test's own (``tmp_path/sandboxes``)."""

    name = "local"
    variants = {"none": {"local_isolation": "none"}}  # weaker walls, the same contract

    def __init__(self, tmp_path: Path, variant: str | None = None) -> None:
        super().__init__(tmp_path, variant)
        self.root = tmp_path / "sandboxes"
        self._seen: set[str] = set()

    @classmethod
    @contextmanager
    def started(cls, tmp_path: Path, variant: str | None = None) -> Iterator[Self]:
        rig = cls(tmp_path, variant)
        rig.root.mkdir(parents=True, mode=0o700)  # as the provider would make it
        yield rig

    @property
    def values(self) -> dict[str, object]:
        return {
            "providers": "local",
            "local_isolation": "bwrap",
            "local_root": self.root,
            **self.overrides,
        }

    def alive(self) -> set[str]:
        # A sandbox is alive while its folder is, or while a process marked as its lives on
        # (a folder removed under a process that escaped the group's kill is not an end).
        ids = {home.name for home in self.root.iterdir()}
        self._seen.update(ids)
        return ids | {i for i in self._seen if marked_pids(i)}

    def lifetime_of(self, sandbox_id: str) -> float | None:
        return float(self._tags(sandbox_id)["lifetime_s"])

    def tags_of(self, sandbox_id: str) -> dict[str, str]:
        return {k: v for k, v in self._tags(sandbox_id).items() if isinstance(v, str)}

    def _tags(self, sandbox_id: str) -> dict[str, object]:
        tags: dict[str, object] = json.loads((self.root / sandbox_id / "tags.json").read_text())
        return tags
