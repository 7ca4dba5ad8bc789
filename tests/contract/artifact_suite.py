"""The artifacts part of the provider contract (item 8 of relay/providers/contract.py): a
sandbox's files read back through the provider's own file API, through its fake, the way
a run collects them (relay/runs/artifacts.py, into a real SQLite store).

A provider joins by adding :class:`ArtifactContract` to its contract class once its driver
reads files (``folder_entries``, ``file_chunks``) and its fake answers the calls its SDK
makes for them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relay.providers.contract import DEFAULT_WORKDIR, OutputSink, Sandbox
from relay.runs.artifacts import Caps, Entry, collect
from relay.store.artifacts import Artifacts
from relay.store.database import Store
from tests.contract.harness import Harness
from tests.contract.suite import spec

WRITES = "echo report > report.txt; echo one > a.png; echo two > b.png; echo gone > c.txt"


async def _exec(box: Sandbox, script: str, timeout_s: float = 20.0) -> None:
    await box.exec(
        ["sh", "-c", script],
        stdin=None,
        env={},
        workdir=None,
        timeout_s=timeout_s,
        output=OutputSink(4096),
    )


async def _kept(store: Artifacts, entry: Entry) -> bytes:
    assert entry.sha256 is not None, entry
    return b"".join([chunk async for chunk in store.chunks(entry.sha256)])


class ArtifactContract:
    """Reading a sandbox's files, on every provider whose driver does."""

    @pytest.fixture
    async def artifact_store(self, tmp_path: Path) -> AsyncIterator[Artifacts]:
        store = await Store.open(f"sqlite:///{tmp_path / 'artifacts.db'}")
        yield Artifacts(store)
        await store.close()

    async def test_two_files_and_a_glob_come_back_and_a_third_past_the_cap_is_marked(
        self, harness: Harness, artifact_store: Artifacts
    ) -> None:
        caps = Caps(file_bytes=1024, run_bytes=13, files=8)  # 7 + 4, then 2 of b.png's 4
        async with harness.provider.sandbox(spec(harness)) as box:
            await _exec(box, WRITES)
            entries = await collect(
                box, ["report.txt", "*.png", "none.txt"], workdir=None, store=artifact_store,
                caps=caps, budget_s=30,
            )  # fmt: skip
            listed = {entry.name: entry for entry in entries}
            assert list(listed) == ["report.txt", "a.png", "b.png", "none.txt"]
        for name, data in (("report.txt", b"report\n"), ("a.png", b"one\n")):
            assert listed[name].sha256 == hashlib.sha256(data).hexdigest()
            assert await _kept(artifact_store, listed[name]) == data
        assert listed["b.png"].truncated and await _kept(artifact_store, listed["b.png"]) == b"tw"
        assert listed["none.txt"].skipped == "not found"

    async def test_files_past_the_file_count_are_listed_as_skipped(
        self, harness: Harness, artifact_store: Artifacts
    ) -> None:
        async with harness.provider.sandbox(spec(harness)) as box:
            await _exec(box, WRITES)
            entries = await collect(
                box, ["*.png", "*.txt"], workdir=None, store=artifact_store,
                caps=Caps(file_bytes=1024, run_bytes=4096, files=2), budget_s=30,
            )  # fmt: skip
        kept = [entry.name for entry in entries if entry.sha256 is not None]
        assert kept == ["a.png", "b.png"]
        skipped = [entry for entry in entries if entry.sha256 is None]
        assert skipped and all("RELAY_ARTIFACTS_MAX_FILES" in (e.skipped or "") for e in skipped)

    async def test_a_timed_out_command_still_leaves_what_it_wrote(
        self, harness: Harness, artifact_store: Artifacts
    ) -> None:
        async with harness.provider.sandbox(spec(harness)) as box:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(2):
                    await _exec(box, "echo early > early.txt; sleep 60", timeout_s=2)
            entries = await collect(
                box, ["early.txt"], workdir=None, store=artifact_store,
                caps=Caps(1024, 1024, 8), budget_s=30,
            )  # fmt: skip
        assert await _kept(artifact_store, entries[0]) == b"early\n"

    async def test_a_missing_folder_is_not_found_and_the_workdir_lists(
        self, harness: Harness
    ) -> None:
        async with harness.provider.sandbox(spec(harness)) as box:
            await _exec(box, "echo x > here.txt")
            names = {entry.name: entry.kind for entry in await box.list_folder(DEFAULT_WORKDIR)}
            assert names.get("here.txt") == "file"
            entries = await collect(
                box, ["nowhere/*.txt"], workdir=None, store=None,  # type: ignore[arg-type]
                caps=Caps(1024, 1024, 8), budget_s=30,
            )  # fmt: skip
        assert [(entry.name, entry.skipped) for entry in entries] == [
            ("nowhere/*.txt", "no file matched")
        ]

    async def test_links_are_listed_never_followed_and_a_fifo_never_read(
        self, harness: Harness, artifact_store: Artifacts
    ) -> None:
        if getattr(self, "rig", "") == "memory":
            pytest.skip("the memory world's files have no links or FIFOs")
        script = (
            "mkdir -p d && echo kept > d/f.txt && ln -s f.txt d/link && ln -s /etc d/etc && "
            "mkfifo d/pipe"
        )
        async with harness.provider.sandbox(spec(harness)) as box:
            await _exec(box, script)
            entries = await collect(
                box, ["d/*", "d/etc/passwd"], workdir=None, store=artifact_store,
                caps=Caps(1024, 4096, 16), budget_s=30,
            )  # fmt: skip
        listed = {entry.name: entry for entry in entries}
        assert await _kept(artifact_store, listed["d/f.txt"]) == b"kept\n"
        for link in ("d/link", "d/etc"):
            assert listed[link].sha256 is None and "link" in (listed[link].skipped or ""), link
        assert "link" in (listed["d/etc/passwd"].skipped or "")
        # A FIFO is skipped as special, or not listed at all (E2B's SDK leaves it out).
        pipe = listed.get("d/pipe")
        assert pipe is None or (
            pipe.sha256 is None and "not a regular file" in (pipe.skipped or "")
        )
