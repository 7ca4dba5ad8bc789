"""Artifacts on the local provider with real bubblewrap: the files a job made come back
after its command ended (its tmpfs read inside the sandbox's own namespaces), also from a
timed-out run, and whatever the job made of its folder (links to host files, FIFOs, a link
to /dev/zero, a 1 TiB sparse file, 10,000 files, awkward names) gives a bounded, safe
listing, never a host file's bytes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from relay.auth import Principal
from relay.providers.local.provider import LocalProvider
from relay.runs.catalog import Catalog
from relay.runs.models import Run, RunRequest
from relay.runs.service import RunService
from relay.runs.view import run_model
from relay.store.artifacts import Artifacts
from relay.store.database import Store
from tests.conftest import REPO, make_settings

PRINCIPAL = Principal(name="maker", command=True)


async def _run(
    tmp_path: Path, script: str, artifacts: list[str], timeout_s: float = 20, **settings: Any
) -> tuple[Run, bytes]:
    """The run of ``script`` and every byte its artifacts kept, concatenated."""
    config = make_settings(tmp_path, local_isolation="bwrap", **settings)
    store = await Store.open(config.database_url)
    provider = LocalProvider(config)
    service = RunService(config, store, Catalog.load(REPO / "jobs"), {"local": provider})
    try:
        request = RunRequest(command=["sh", "-c", script], artifacts=artifacts, timeout_s=timeout_s)
        row, _ = await service.submit(PRINCIPAL, request, None)
        await service.wait(row.id, 60)
        run = run_model(await service.get(PRINCIPAL, row.id))
        kept = b""
        for entry in run.artifacts:
            if entry.sha256 is not None:
                kept += b"".join([c async for c in Artifacts(store).chunks(entry.sha256)])
    finally:
        await service.shutdown()
        await store.close()
    assert list((tmp_path / "sandboxes").iterdir()) == []  # terminated as always
    return run, kept


async def test_the_files_a_job_made_come_back_after_its_command_ended(tmp_path: Path) -> None:
    script = (
        "mkdir -p out/charts && echo '{\"ok\": 1}' > out/report.json && "
        "printf one > out/charts/a.png && printf two > out/charts/b.png && "
        "head -c 5000 /dev/urandom > out/charts/c.png && exit 4"
    )
    run, _ = await _run(
        tmp_path, script, ["out/report.json", "out/charts/*.png"], artifacts_max_run_bytes=1000
    )
    assert run.state == "failed" and run.exit_code == 4
    listed = {entry.name: entry for entry in run.artifacts}
    assert listed["out/report.json"].sha256 == hashlib.sha256(b'{"ok": 1}\n').hexdigest()
    assert listed["out/charts/a.png"].sha256 == hashlib.sha256(b"one").hexdigest()
    assert listed["out/charts/b.png"].sha256 == hashlib.sha256(b"two").hexdigest()
    third = listed["out/charts/c.png"]  # 5000 bytes past the run's 1000
    assert third.truncated and third.size == 1000 - 10 - 3 - 3
    assert third.truncated_by == "RELAY_ARTIFACTS_MAX_RUN_BYTES (1000)"


async def test_a_timed_out_run_keeps_what_it_wrote_before_the_deadline(tmp_path: Path) -> None:
    run, kept = await _run(tmp_path, "echo early > early.txt; sleep 60", ["early.txt"], 1)
    assert run.state == "timed_out"
    assert [entry.name for entry in run.artifacts] == ["early.txt"] and kept == b"early\n"


async def test_hostile_files_give_a_bounded_safe_listing_and_never_a_host_file(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret\n")
    script = (
        f"mkdir -p out/many && ln -s {secret} out/secret.txt && ln -s /etc out/etc && "
        "ln -s /dev/zero out/zero && mkfifo out/fifo && "
        # The sandbox's RLIMIT_FSIZE (its disk size) refuses 1 TiB: then as large as it may.
        "{ truncate -s 1T out/sparse 2>/dev/null || truncate -s 100M out/sparse; } && "
        "printf ok > out/plain.txt && touch \"$(printf 'out/bad\\nname')\" && "
        "cd out/many && seq 10000 | xargs touch"
    )
    started = time.monotonic()
    run, kept = await _run(
        tmp_path,
        script,
        ["out/*", "out/etc/passwd", "out/secret.txt", "out/many/*"],
        artifacts_max_file_bytes=4096,
        artifacts_max_files=20,
    )
    assert time.monotonic() - started < 60
    assert b"host secret" not in kept and b"root:" not in kept
    listed = {entry.name: entry for entry in run.artifacts}
    for link in ("out/secret.txt", "out/zero", "out/etc"):
        assert listed[link].skipped == "a symbolic link (links are not followed)", link
    assert "not a regular file" in (listed["out/fifo"].skipped or "")
    assert listed["out/sparse"].size == 4096 and listed["out/sparse"].truncated
    assert listed["out/plain.txt"].sha256 == hashlib.sha256(b"ok").hexdigest()
    assert listed["out/bad\ufffdname"].skipped == "its name has control characters"
    assert "symbolic link" in (listed["out/etc/passwd"].skipped or "")
    # 10,000 files: 20 kept at most, 20 more listed, then one entry counting the rest.
    assert len(run.artifacts) <= 2 * 20 + 4
    assert sum(entry.sha256 is not None for entry in run.artifacts) <= 20
    assert any("more matches" in (entry.skipped or "") for entry in run.artifacts)
