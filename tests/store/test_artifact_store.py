"""Artifacts in the store (relay/store/artifacts.py) on a real SQLite file and a real
PostgreSQL: contents chunked and kept once by SHA-256, read back in chunks and ranges, seen
by a second replica, and pruned with their runs (with the bytes freed counted)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from relay.store import retention
from relay.store.artifacts import Artifacts, BlobMissing, StoredArtifact
from relay.store.database import Store
from relay.store.schema import (
    SCHEMA_VERSION,
    artifact_blobs,
    artifact_chunks,
    meta,
    metadata,
    run_artifacts,
    runs,
    token_artifacts,
)
from testing.rows import run_row

OLD = time.time() - 40 * 86_400.0


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    opened = await Store.open(database_url)
    yield opened
    await opened.close()


async def _keep(artifacts: Artifacts, data: bytes, chunk_bytes: int = 1000) -> str:
    writer = artifacts.writer()
    writer.chunk_bytes = chunk_bytes
    for start in range(0, len(data), 777):  # writes that straddle chunks
        await writer.write(data[start : start + 777])
    digest, size = await writer.finish()
    assert size == len(data)
    return digest


async def _read(artifacts: Artifacts, digest: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join([chunk async for chunk in artifacts.chunks(digest, start, end)])


async def _count(store: Store, table: sa.Table) -> int:
    query = sa.select(sa.func.count()).select_from(table)
    return int(await store.read(lambda conn: conn.scalar(query) or 0))


async def test_content_is_chunked_kept_once_and_read_back_in_chunks_and_ranges(
    store: Store,
) -> None:
    artifacts = Artifacts(store)
    data = bytes(range(256)) * 40  # 10,240 bytes: eleven chunks of 1,000
    digest = await _keep(artifacts, data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert await _keep(artifacts, data) == digest  # the same content again: stored once
    assert await _count(store, artifact_blobs) == 1
    assert await _count(store, artifact_chunks) == 11
    chunks = [chunk async for chunk in artifacts.chunks(digest)]
    assert max(len(chunk) for chunk in chunks) == 1000 and b"".join(chunks) == data
    assert await _read(artifacts, digest, 999, 2001) == data[999:2001]
    assert await _read(artifacts, digest, 10_000) == data[10_000:]
    with pytest.raises(BlobMissing):
        await _read(artifacts, "0" * 64)


async def test_a_second_replica_reads_the_same_listing_and_content(database_url: str) -> None:
    first, second = await Store.open(database_url), await Store.open(database_url)
    try:
        digest = await _keep(Artifacts(first), b"chart" * 500)
        entries = [
            StoredArtifact("out/chart.png", 2500, digest, "image/png"),
            StoredArtifact("out/gone.txt", skipped="not found"),
        ]
        await Artifacts(first).record("run_a", entries)
        other = Artifacts(second)
        assert (await other.for_runs(["run_a", "run_b"])) == {"run_a": entries}
        found = await other.find("run_a", "out/chart.png")
        assert found is not None and found.sha256 == digest
        assert await other.find("run_a", "out/gone.txt") is None  # skipped: nothing to read
        assert await _read(other, digest) == b"chart" * 500
    finally:
        await first.close()
        await second.close()


async def test_pruning_a_run_deletes_its_listing_and_the_content_no_other_run_names(
    store: Store,
) -> None:
    artifacts = Artifacts(store)
    shared = await _keep(artifacts, b"s" * 3000)
    alone = await _keep(artifacts, b"a" * 4500)
    for run_id, created in (("run_old", OLD), ("run_new", time.time())):
        await store.admit_run(run_row(run_id, state="succeeded", created_at=created))
    await artifacts.record(
        "run_old", [StoredArtifact("s", 3000, shared), StoredArtifact("a", 4500, alone)]
    )
    await artifacts.record("run_new", [StoredArtifact("s", 3000, shared)])
    # Stored long ago (written now, so aged by hand): only blobs last used before the
    # cutoff are pruned, never one a run is naming right now.
    await store.write(lambda conn: conn.execute(artifact_blobs.update().values(used_at=OLD)))
    before = retention.cutoff(30)

    counted = await retention.prune(store, before, dry_run=True)
    assert (counted.runs, counted.artifacts, counted.artifact_bytes) == (1, 1, 4500)
    pruned = await retention.prune(store, before)
    assert (pruned.runs, pruned.artifacts, pruned.artifact_bytes) == (1, 1, 4500)

    assert await artifacts.for_runs(["run_old"]) == {}
    assert await _read(artifacts, shared) == b"s" * 3000  # run_new still names it
    assert await artifacts.blob(alone) is None
    assert await _count(store, artifact_chunks) == 3  # shared's three chunks only
    assert await _count(store, run_artifacts) == 1


async def test_an_upload_a_relay_died_in_is_pruned_once_old(store: Store) -> None:
    artifacts = Artifacts(store)
    writer = artifacts.writer()
    writer.chunk_bytes = 100
    writer.upload = f"up_{int(OLD):010d}_dead"  # begun 40 days ago, never finished
    await writer.write(b"x" * 250)
    fresh = artifacts.writer()
    fresh.chunk_bytes = 100
    await fresh.write(b"y" * 250)  # being written right now
    await retention.prune(store, retention.cutoff(30))
    left = await store.read(lambda conn: conn.scalars(sa.select(artifact_chunks.c.blob)).all())
    assert set(left) == {fresh.upload}


async def test_a_tokens_kept_bytes_follow_its_listings_and_their_pruning(store: Store) -> None:
    """What RELAY_ARTIFACTS_MAX_TOKEN_BYTES is checked against: the kept sizes of a token's
    listings (a skipped entry nothing), one listing written again counted once, each
    token its own, and a prune taking a pruned run's share off."""
    artifacts = Artifacts(store)
    for run_id, token, created in (
        ("run_old", "ops", OLD),
        ("run_new", "ops", time.time()),
        ("run_theirs", "other", OLD),
    ):
        await store.admit_run(run_row(run_id, token=token, state="succeeded", created_at=created))
    listing = [StoredArtifact("a", 100, "a" * 64), StoredArtifact("b", skipped="not found")]
    await artifacts.record("run_old", listing)
    await artifacts.record("run_old", listing)  # a cancel cut the first write's answer
    await artifacts.record("run_new", [StoredArtifact("c", 20, "c" * 64)])
    await artifacts.record("run_theirs", [StoredArtifact("d", 7, "d" * 64)])
    assert await artifacts.token_bytes("ops") == 120
    assert await artifacts.token_bytes("other") == 7
    assert await artifacts.token_bytes("nobody") == 0
    await retention.prune(store, retention.cutoff(30))
    assert await artifacts.token_bytes("ops") == 20
    assert await artifacts.token_bytes("other") == 0


async def test_a_listing_the_count_never_had_never_takes_it_below_zero(store: Store) -> None:
    """A replica still on schema 12 while another upgrades writes listings the count never
    sees; their prune takes them off: the count stops at 0, never below (it was -100, and
    the token's next runs kept 100 bytes past its cap)."""
    artifacts = Artifacts(store)
    await store.admit_run(run_row("run_old", token="ops", state="succeeded", created_at=OLD))
    await store.admit_run(run_row("run_new", token="ops", state="succeeded"))
    entry = {"run_id": "run_old", "seq": 0, "content_type": "text/plain", "name": "a"}
    await store.write(  # what schema 12's record wrote: the rows, no count
        lambda conn: conn.execute(run_artifacts.insert().values(**entry, size=100, sha256="a" * 64))
    )
    await retention.prune(store, retention.cutoff(30))
    assert await artifacts.token_bytes("ops") == 0
    await artifacts.record("run_new", [StoredArtifact("c", 30, "c" * 64)])
    assert await artifacts.token_bytes("ops") == 30


async def test_upgrading_from_version_12_counts_the_listings_there_are(database_url: str) -> None:
    def version_12(conn: sa.Connection) -> None:  # today's tables, less what 13 added
        kept = [t for t in metadata.sorted_tables if t is not token_artifacts]
        metadata.create_all(conn, tables=kept)
        conn.execute(meta.insert().values(key="schema_version", value="12"))
        for run_id, token in (("run_1", "ops"), ("run_2", "ops"), ("run_3", "other")):
            conn.execute(runs.insert().values(**run_row(run_id, token=token).columns()))
            entry = {"run_id": run_id, "content_type": "text/plain"}
            conn.execute(
                run_artifacts.insert(),
                [
                    {**entry, "seq": 0, "name": "a", "size": 10, "sha256": "a" * 64},
                    {**entry, "seq": 1, "name": "b", "size": 0, "sha256": None},
                ],
            )

    old = await Store.open(database_url, migrate=False)
    try:
        await old.write(version_12)
    finally:
        await old.close()
    store = await Store.open(database_url)
    try:
        assert await store.schema_version() == SCHEMA_VERSION
        artifacts = Artifacts(store)
        assert (await artifacts.token_bytes("ops"), await artifacts.token_bytes("other")) == (
            20,
            10,
        )
    finally:
        await store.close()
