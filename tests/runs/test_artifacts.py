"""A run's artifacts through the real service, store (SQLite) and the memory provider:
collected before the sandbox ends, kept content-addressed, listed on the run's JSON, held
to their caps, and required where the job says so."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from relay.auth import Principal
from relay.providers.collection import Found, found_files
from relay.providers.memory import MemoryProvider, MemorySandbox, MemoryWorld
from relay.runs import artifacts
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.runs.view import run_model
from relay.store import retention
from relay.store.artifacts import Artifacts
from relay.store.database import Store
from relay.store.schema import artifact_chunks
from tests.conftest import make_settings

PRINCIPAL = Principal(name="maker", command=True)
WRITES = "echo report > out/report.json; echo one > out/a.png; echo two > out/b.png; exit 3"


async def _run(tmp_path: Path, artifacts: list[str], **settings: Any) -> tuple[Any, Store]:
    config = make_settings(tmp_path, providers=["memory"], **settings)
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        request = RunRequest(command=["sh", "-c", WRITES], artifacts=artifacts)
        row, _ = await service.submit(PRINCIPAL, request, None)
        await service.wait(row.id, 10)
        run = await service.get(PRINCIPAL, row.id)
    finally:
        await service.shutdown()
    assert world.alive() == set()
    return run_model(run), store


async def _content(store: Store, sha256: str) -> bytes:
    return b"".join([chunk async for chunk in Artifacts(store).chunks(sha256)])


async def test_a_failed_runs_file_and_glob_come_back_listed_with_their_hashes(
    tmp_path: Path,
) -> None:
    run, store = await _run(tmp_path, ["out/report.json", "out/*.png", "out/missing.txt"])
    try:
        assert run.state == "failed" and run.exit_code == 3
        listed = {entry.name: entry for entry in run.artifacts}
        assert list(listed) == ["out/report.json", "out/a.png", "out/b.png", "out/missing.txt"]
        for name, text in (("out/report.json", b"report\n"), ("out/a.png", b"one\n")):
            entry = listed[name]
            assert entry.sha256 == hashlib.sha256(text).hexdigest() and entry.size == len(text)
            assert await _content(store, entry.sha256) == text
            assert entry.url == f"/v1/runs/{run.id}/{'artifacts'}/{name}"
        assert listed["out/report.json"].content_type == "application/json"
        assert listed["out/a.png"].content_type == "image/png"
        assert listed["out/missing.txt"].skipped == "not found"
        assert listed["out/missing.txt"].url is None
        assert run.timings.artifacts_ms is not None
    finally:
        await store.close()


async def test_files_past_the_run_cap_are_truncated_then_skipped(tmp_path: Path) -> None:
    # 7 bytes of report, then 4 of a.png cut to 3 at the run's 10 bytes, then b.png skipped.
    run, store = await _run(tmp_path, ["out/report.json", "out/*.png"], artifacts_max_run_bytes=10)
    try:
        report, first, second = run.artifacts
        assert (report.size, report.truncated) == (7, False)
        assert (first.size, first.truncated) == (3, True)
        assert first.truncated_by == "RELAY_ARTIFACTS_MAX_RUN_BYTES (10)"
        assert await _content(store, first.sha256 or "") == b"one"
        assert second.sha256 is None and second.url is None
        assert "RELAY_ARTIFACTS_MAX_RUN_BYTES" in (second.skipped or "")
    finally:
        await store.close()


async def test_files_past_the_file_count_are_listed_as_skipped(tmp_path: Path) -> None:
    run, store = await _run(tmp_path, ["out/*"], artifacts_max_files=2)
    try:
        assert [entry.name for entry in run.artifacts] == [
            "out/a.png",
            "out/b.png",
            "out/report.json",
        ]
        assert [entry.sha256 is not None for entry in run.artifacts] == [True, True, False]
        assert "RELAY_ARTIFACTS_MAX_FILES" in (run.artifacts[2].skipped or "")
    finally:
        await store.close()


async def test_a_canceled_run_keeps_what_it_wrote_before_the_cancel(tmp_path: Path) -> None:
    config = make_settings(tmp_path, providers=["memory"])
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        script = "echo early > early.txt; sleep 30"
        request = RunRequest(command=["sh", "-c", script], artifacts=["early.txt"], wait=False)
        row, _ = await service.submit(PRINCIPAL, request, None)
        for _ in range(100):  # until the script has written its file
            if any(box.files for box in world.boxes.values()):
                break
            await asyncio.sleep(0.02)
        await service.cancel(PRINCIPAL, row.id)
        run = run_model(await service.get(PRINCIPAL, row.id))
        assert run.state == "canceled"
        (kept,) = run.artifacts
        assert kept.name == "early.txt" and await _content(store, kept.sha256 or "") == b"early\n"
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


@pytest.mark.parametrize("stop", ["delete", "shutdown"])
async def test_a_cancel_while_a_succeeded_jobs_required_files_are_kept_does_not_read_succeeded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """A job that requires its artifacts whole has not succeeded until they are kept: a
    DELETE (or the relay's shutdown) that lands after its command exited 0, while its files
    are being collected, cut the collection short, so the run may not read succeeded without
    them (it did: the command's exit was kept as the outcome before the files were)."""
    job = tmp_path / "jobs" / "report"
    job.mkdir(parents=True)
    (job / "job.toml").write_text(
        'description = "A report it requires whole."\n'
        'command = ["sh", "-c", "echo report > report.txt"]\n'
        'provider = "memory"\n'
        'artifacts = ["report.txt"]\n'
        "artifacts_required = true\n"
    )
    config = make_settings(tmp_path, providers=["memory"], jobs_dir=tmp_path / "jobs", drain_s=0)
    collecting = asyncio.Event()

    async def collect_never_ends(*args: Any, **kwargs: Any) -> list[Any]:
        collecting.set()
        await asyncio.Event().wait()  # a sandbox whose files never come back; cancelled
        return []

    monkeypatch.setattr(artifacts, "collect", collect_never_ends)
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        row, _ = await service.submit(PRINCIPAL, RunRequest(job="report", wait=False), None)
        async with asyncio.timeout(10):
            await collecting.wait()
        if stop == "delete":
            await service.cancel(PRINCIPAL, row.id)
        else:
            await service.shutdown()
        run = run_model(await service.get(PRINCIPAL, row.id))
        assert run.state == "canceled", (run.state, run.artifacts)
        code = run.error.code if run.error is not None else None
        assert code == (None if stop == "delete" else "shutting_down")
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


@pytest.mark.parametrize(
    ("stop", "store_fails"), [("delete", False), ("shutdown", False), ("delete", True)]
)
async def test_a_cancel_while_a_succeeded_jobs_files_are_kept_lists_what_was_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str, store_fails: bool
) -> None:
    """A DELETE (or the relay's shutdown) that lands after the command exited 0, while its
    optional files are read: the run keeps its success, and its listing names the file kept
    and the one the cancel cut short (it had no listing at all: "the job made no files").
    A store that then fails to keep the listing leaves the success, unlisted (not an
    ``internal`` error)."""
    job = tmp_path / "jobs" / "report"
    job.mkdir(parents=True)
    (job / "job.toml").write_text(
        'description = "Two files, the second slow to read."\n'
        'command = ["sh", "-c", "echo first > a.txt; echo second > b.txt"]\n'
        'provider = "memory"\n'
        'artifacts = ["a.txt", "b.txt"]\n'
    )
    config = make_settings(tmp_path, providers=["memory"], jobs_dir=tmp_path / "jobs", drain_s=0)
    reading = asyncio.Event()
    chunks = MemorySandbox.file_chunks

    def slow_second(self: MemorySandbox, path: str, limit: int, size: int | None) -> Any:
        if path.endswith("b.txt"):
            reading.set()
            return _never_answers()
        return chunks(self, path, limit, size)

    monkeypatch.setattr(MemorySandbox, "file_chunks", slow_second)
    if store_fails:

        async def record_fails(*args: Any) -> None:
            raise OSError("the store is down")

        monkeypatch.setattr(Artifacts, "record", record_fails)
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        row, _ = await service.submit(PRINCIPAL, RunRequest(job="report", wait=False), None)
        async with asyncio.timeout(10):
            await reading.wait()
        if stop == "delete":
            await service.cancel(PRINCIPAL, row.id)
        else:
            await service.shutdown()
        run = run_model(await service.get(PRINCIPAL, row.id))
        assert (run.state, run.exit_code, run.error) == ("succeeded", 0, None)
        if store_fails:
            assert run.artifacts == []
            return
        kept, cut = run.artifacts
        assert kept.name == "a.txt" and await _content(store, kept.sha256 or "") == b"first\n"
        assert (cut.name, cut.sha256, cut.url) == ("b.txt", None, None)
        assert cut.skipped is not None and cut.skipped.startswith(artifacts.CUT_SHORT)
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


async def _never_answers() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()  # a read that never answers; cancelled
    yield b""


async def test_a_delete_as_a_succeeded_jobs_listing_is_written_leaves_it_succeeded_and_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE lands while the listing's write is awaited, after it was written (as a
    PostgreSQL write may be, committed before its answer came): the write goes on to its
    answer and the run lists it. The run stays the job's success, listed; it read succeeded
    with no artifacts (the listing lost with the cancelled await)."""
    record = Artifacts.record
    written = asyncio.Event()

    async def answered_late(self: Artifacts, run_id: str, entries: Any) -> None:
        await record(self, run_id, entries)
        if not written.is_set():
            written.set()
            await asyncio.sleep(0.5)  # written; its answer comes late, after the DELETE

    monkeypatch.setattr(Artifacts, "record", answered_late)
    config = make_settings(tmp_path, providers=["memory"])
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        script = "echo a > a.txt"
        request = RunRequest(command=["sh", "-c", script], artifacts=["a.txt"], wait=False)
        row, _ = await service.submit(PRINCIPAL, request, None)
        async with asyncio.timeout(10):
            await written.wait()
            await service.cancel(PRINCIPAL, row.id)
        run = run_model(await service.get(PRINCIPAL, row.id))
        assert (run.state, run.exit_code) == ("succeeded", 0), run.error
        assert [entry.name for entry in run.artifacts or []] == ["a.txt"]
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


async def test_a_token_at_its_artifact_cap_has_its_next_file_skipped_until_a_prune(
    tmp_path: Path, database_url: str
) -> None:
    """What one token's runs keep together is capped (RELAY_ARTIFACTS_MAX_TOKEN_BYTES),
    counted in the store: its next run's file is listed skipped, its result kept; another
    token's run keeps its files; a token's own ``max_artifact_bytes`` is its cap instead;
    pruning the runs frees it (before, one tenant's runs could fill the store for all)."""
    config = make_settings(
        tmp_path, providers=["memory"], database_url=database_url,
        artifacts_max_token_bytes=12,
    )  # fmt: skip
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    other = Principal(name="other", command=True)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )

    async def run(principal: Principal, names: list[str]) -> Any:
        request = RunRequest(command=["sh", "-c", WRITES], artifacts=names)
        row, _ = await service.submit(principal, request, None)
        await service.wait(row.id, 10)
        return run_model(await service.get(principal, row.id))

    try:
        # 7 + 4 bytes kept: 11 of the token's 12.
        first = await run(PRINCIPAL, ["out/report.json", "out/a.png"])
        assert [entry.size for entry in first.artifacts] == [7, 4]
        assert all(entry.sha256 is not None for entry in first.artifacts)
        # Its next file would pass the cap: listed skipped, the run's result kept.
        over_run = await run(PRINCIPAL, ["out/b.png"])
        assert over_run.state == "failed" and over_run.exit_code == 3
        (over,) = over_run.artifacts
        assert over.sha256 is None and over.url is None and over.size == 0
        assert over.skipped == (
            "the token's stored artifacts would pass RELAY_ARTIFACTS_MAX_TOKEN_BYTES (12)"
        )
        assert await Artifacts(store).token_bytes("maker") == 11
        # Another token's run keeps its files.
        theirs = await run(other, ["out/b.png", "out/report.json"])
        assert all(entry.sha256 is not None for entry in theirs.artifacts)
        # A token's own cap: 3 bytes, so a 4-byte file is skipped whole, never cut.
        small = Principal(name="small", command=True, max_artifact_bytes=3)
        (mine,) = (await run(small, ["out/b.png"])).artifacts
        assert mine.sha256 is None and mine.truncated is False
        assert mine.skipped == (
            "the token's stored artifacts would pass the token's max_artifact_bytes (3)"
        )
        # A prune frees the token's share.
        await retention.prune(store, time.time() + 1)
        assert await Artifacts(store).token_bytes("maker") == 0
        (freed,) = (await run(PRINCIPAL, ["out/b.png"])).artifacts
        assert freed.sha256 is not None and freed.skipped is None
        assert await _content(store, freed.sha256) == b"two\n"
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


async def test_a_job_requiring_its_files_whole_fails_when_the_tokens_cap_skips_one(
    tmp_path: Path,
) -> None:
    """Past the token's cap a job with ``artifacts_required`` fails as it does past the
    run's: ``artifacts_incomplete``, naming the file skipped."""
    job = tmp_path / "jobs" / "report"
    job.mkdir(parents=True)
    (job / "job.toml").write_text(
        'description = "A report it requires whole."\n'
        'command = ["sh", "-c", "echo report > report.txt"]\n'
        'provider = "memory"\n'
        'artifacts = ["report.txt"]\n'
        "artifacts_required = true\n"
    )
    config = make_settings(
        tmp_path, providers=["memory"], jobs_dir=tmp_path / "jobs", artifacts_max_token_bytes=3
    )
    world = MemoryWorld()
    store = await Store.open(config.database_url)
    service = RunService(
        config, store, Catalog.load(config.jobs_dir), {"memory": MemoryProvider(config, world)}
    )
    try:
        row, _ = await service.submit(PRINCIPAL, RunRequest(job="report"), None)
        await service.wait(row.id, 10)
        run = run_model(await service.get(PRINCIPAL, row.id))
        assert run.state == "failed" and run.exit_code == 0
        assert run.error is not None and run.error.code == "artifacts_incomplete"
        assert "report.txt was skipped" in run.error.message
        assert "RELAY_ARTIFACTS_MAX_TOKEN_BYTES (3)" in (run.artifacts[0].skipped or "")
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


async def test_a_file_of_unlisted_size_past_the_tokens_room_is_skipped_not_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider that does not list sizes: the file is read up to the token's room and
    one byte more, and then listed skipped (not kept cut, nothing of it left stored)."""
    listed = found_files

    async def sizeless(*args: Any, **kwargs: Any) -> AsyncIterator[Found]:
        async for found in listed(*args, **kwargs):
            yield dataclasses.replace(found, size=None)

    monkeypatch.setattr(artifacts, "found_files", sizeless)
    run, store = await _run(
        tmp_path, ["out/report.json", "out/a.png"], artifacts_max_token_bytes=10
    )
    try:
        report, png = run.artifacts
        assert report.sha256 is not None and report.size == 7
        assert png.sha256 is None and png.truncated is False and png.size == 0
        assert png.skipped == (
            "the token's stored artifacts would pass RELAY_ARTIFACTS_MAX_TOKEN_BYTES (10)"
        )
        chunks = sa.select(sa.func.count()).select_from(artifact_chunks)
        assert await store.read(lambda conn: conn.scalar(chunks)) == 1  # report's alone
    finally:
        await store.close()
