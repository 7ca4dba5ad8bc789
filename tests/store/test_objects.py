"""Artifacts' contents in object storage (relay/store/objects.py, RELAY_ARTIFACTS_URL):
against moto's S3 server on 127.0.0.1 (a real S3 endpoint, spoken to over HTTP by obstore)
and a file:// folder. Contents go to the bucket named by their hash, kept once, read back
byte-identical (whole and in ranges) by a second replica on the same store, pruned with the
last run naming them; an object deleted behind the relay's back is a clear 410, and a URL
that cannot be used stops the start naming the setting."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from moto.server import ThreadedMotoServer
from starlette.testclient import TestClient

from relay.auth import new_token
from relay.cli.prune import _prune as prune_command
from relay.errors import ConfigError
from relay.http.app import create_app
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.store import retention
from relay.store.artifacts import Artifacts, BlobMissing, StoredArtifact
from relay.store.database import Store
from relay.store.objects import Objects
from relay.store.schema import artifact_blobs, artifact_chunks
from testing.rows import run_row
from tests.conftest import make_settings

OLD = time.time() - 40 * 86_400.0
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1; its endpoint URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket for one test."""
    name = "relay-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:20]
    _client(s3).create_bucket(Bucket=name)
    return name


def _client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _config(endpoint: str) -> dict[str, Any]:
    return {
        "aws_region": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }


def _keys(endpoint: str, bucket: str) -> list[str]:
    listed = _client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listed.get("Contents", []))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    yield opened
    await opened.close()


async def _keep(artifacts: Artifacts, data: bytes) -> str:
    writer = artifacts.writer()
    for start in range(0, len(data), 100_000):
        await writer.write(data[start : start + 100_000])
    digest, size = await writer.finish()
    assert size == len(data)
    return digest


async def _read(artifacts: Artifacts, digest: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join([chunk async for chunk in artifacts.chunks(digest, start, end)])


async def test_contents_go_to_the_bucket_by_hash_once_and_a_second_replica_reads_them(
    database_url: str, s3: str, bucket: str
) -> None:
    first, second = await Store.open(database_url), await Store.open(database_url)
    try:
        objects = await Objects.open(f"s3://{bucket}/relay/artifacts", _config(s3), s3)
        data = hashlib.sha256(b"seed").digest() * 400_000  # 12.8 MB: a multipart upload
        digest = await _keep(Artifacts(first, objects), data)
        assert digest == hashlib.sha256(data).hexdigest()
        assert await _keep(Artifacts(first, objects), data) == digest  # the same: kept once
        assert _keys(s3, bucket) == [f"relay/artifacts/{digest}"]
        chunk_rows = sa.select(sa.func.count()).select_from(artifact_chunks)
        assert await first.read(lambda conn: conn.scalar(chunk_rows)) == 0  # none in the store
        entry = StoredArtifact("out/big.bin", len(data), digest)
        await Artifacts(first, objects).record("run_a", [entry])
        other = Artifacts(
            second, await Objects.open(f"s3://{bucket}/relay/artifacts", _config(s3), s3)
        )
        assert await other.find("run_a", "out/big.bin") == entry
        assert await _read(other, digest) == data
        assert await _read(other, digest, 999, 5_000_001) == data[999:5_000_001]
    finally:
        await first.close()
        await second.close()


async def test_a_discarded_upload_leaves_no_object_and_no_row(
    store: Store, s3: str, bucket: str
) -> None:
    objects = await Objects.open(f"s3://{bucket}/a", _config(s3), s3)
    writer = Artifacts(store, objects).writer()
    await writer.write(b"half a file")
    await writer.discard()
    assert _keys(s3, bucket) == []
    assert await Artifacts(store, objects).blob(hashlib.sha256(b"half a file").hexdigest()) is None


async def test_pruning_the_last_run_naming_a_content_deletes_its_object(
    store: Store, s3: str, bucket: str
) -> None:
    objects = await Objects.open(f"s3://{bucket}/p", _config(s3), s3)
    artifacts = Artifacts(store, objects)
    digest = await _keep(artifacts, b"report" * 1000)
    await store.admit_run(run_row("run_old", state="succeeded", created_at=OLD))
    await artifacts.record("run_old", [StoredArtifact("r.txt", 6000, digest)])
    future = time.time() + 60  # the blob was used just now: a cutoff past it
    dry = await retention.prune(store, future, dry_run=True, objects=objects)
    assert (dry.artifacts, dry.artifact_bytes) == (1, 6000)
    assert _keys(s3, bucket) == [f"p/{digest}"]
    done = await retention.prune(store, future, objects=objects)
    assert (done.runs, done.artifacts, done.artifact_bytes) == (1, 1, 6000)
    assert _keys(s3, bucket) == []
    with pytest.raises(BlobMissing):
        await _read(artifacts, digest)


async def test_an_upload_a_relay_died_in_is_deleted_from_the_bucket_once_old(
    store: Store, s3: str, bucket: str
) -> None:
    objects = await Objects.open(f"s3://{bucket}/u", _config(s3), s3)
    _client(s3).put_object(Bucket=bucket, Key="u/uploads/up_0000000100_dead", Body=b"x")
    fresh = f"u/uploads/up_{int(time.time()):010d}_alive"  # being written now: kept
    _client(s3).put_object(Bucket=bucket, Key=fresh, Body=b"y")
    await retention.prune(store, time.time() - 5, objects=objects)
    assert _keys(s3, bucket) == [fresh]


async def test_a_file_url_keeps_contents_in_the_folder(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "artifacts"
    artifacts = Artifacts(store, await Objects.open(folder.as_uri()))
    digest = await _keep(artifacts, b"local bytes" * 50_000)
    assert (folder / digest).read_bytes() == b"local bytes" * 50_000
    assert await _read(artifacts, digest, 5, 16) == (b"local bytes" * 2)[5:16]
    assert [path.name for path in (folder / "uploads").iterdir()] == []


async def test_a_url_that_cannot_be_used_stops_the_start_naming_the_setting(s3: str) -> None:
    with pytest.raises(ConfigError, match="RELAY_ARTIFACTS_URL 'ftp://host/x'"):
        await Objects.open("ftp://host/x")
    with pytest.raises(ConfigError, match="RELAY_ARTIFACTS_URL 's3://no-such-bucket/x'") as got:
        await Objects.open("s3://no-such-bucket/x", _config(s3), s3)
    assert "testing" not in str(got.value)  # the keys are never printed
    with pytest.raises(ConfigError, match="RELAY_ARTIFACTS_URL"):  # obstore panics on it
        await Objects.open("s3://bucket/x", {"aws_allow_http": "true"})


BIG = "z" * 400
WRITES = f"echo {BIG} > out/zeros.bin; echo hi > out/hi.txt"


def _relay(tmp_path: Path, s3: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    # The relay reads its bucket's credentials as obstore does, from AWS_*.
    for name, value in {**KEYS, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    settings = make_settings(
        tmp_path, providers=["memory"], artifacts_url=f"s3://{bucket}/runs", artifacts_endpoint=s3
    )
    token = new_token(settings.tokens_file, "ops", command=True)
    provider = MemoryProvider(settings, MemoryWorld())
    client = TestClient(create_app(settings, providers={"memory": provider}))
    client.headers["Authorization"] = f"Bearer {token}"
    return client


def test_a_runs_artifacts_download_from_the_bucket_and_a_deleted_object_is_410(
    tmp_path: Path, s3: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _relay(tmp_path, s3, bucket, monkeypatch) as client:
        body = {"command": ["sh", "-c", WRITES], "artifacts": ["out/*"]}
        answer = client.post("/v1/runs?wait=10", json=body)
        assert answer.status_code == 200, answer.text
        run = answer.json()
        listed = {entry["name"]: entry for entry in run["artifacts"]}
        zeros = listed["out/zeros.bin"]
        expected = (BIG + "\n").encode()
        assert zeros["sha256"] == hashlib.sha256(expected).hexdigest()
        assert f"runs/{zeros['sha256']}" in _keys(s3, bucket)
        got = client.get(zeros["url"])
        assert got.status_code == 200 and got.content == expected
        assert hashlib.sha256(got.content).hexdigest() == got.headers["etag"].strip('"')
        _client(s3).delete_object(Bucket=bucket, Key=f"runs/{listed['out/hi.txt']['sha256']}")
        gone = client.get(listed["out/hi.txt"]["url"])
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "artifact_gone"


async def test_relay_prune_deletes_the_objects_and_counts_their_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "bucket"
    settings = make_settings(tmp_path, artifacts_url=folder.as_uri())
    store = await Store.open(settings.database_url)
    try:
        artifacts = Artifacts(store, await Objects.open(folder.as_uri()))
        digest = await _keep(artifacts, b"old report" * 100)
        await store.admit_run(run_row("run_old", state="succeeded", created_at=OLD))
        await artifacts.record("run_old", [StoredArtifact("r.txt", 1000, digest)])
        await store.write(  # last used long ago, as the run that named it
            lambda conn: conn.execute(artifact_blobs.update().values(used_at=OLD))
        )
    finally:
        await store.close()
    assert (folder / digest).exists()
    assert await prune_command(settings, 30, dry_run=False) == 0
    assert not (folder / digest).exists()
    assert "1 artifact content(s) no run names: 1000 bytes" in capsys.readouterr().out


def test_a_bucket_that_fails_mid_run_lists_the_files_skipped_and_keeps_the_result(
    tmp_path: Path, s3: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _relay(tmp_path, s3, bucket, monkeypatch) as client:
        _client(s3).delete_bucket(Bucket=bucket)  # gone after the start's check
        body = {"command": ["sh", "-c", WRITES + "; exit 3"], "artifacts": ["out/hi.txt"]}
        answer = client.post("/v1/runs?wait=10", json=body)
        assert answer.status_code == 200, answer.text
        run = answer.json()
        assert run["state"] == "failed" and run["exit_code"] == 3  # the command's own result
        (entry,) = run["artifacts"]
        assert entry["skipped"] == "the artifact storage did not take it"
        assert entry["sha256"] is None and entry["url"] is None
