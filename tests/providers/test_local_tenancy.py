"""The local provider's bounds between tenants (issue 34), part by part: the sandboxes'
share of the host's file table, their cap, and the uids a root relay gives them."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from relay.errors import ConfigError, ProviderRateLimited
from relay.providers.contract import OutputSink, Sandbox, SandboxSpec
from relay.providers.local import file_table, uids
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.provider import LocalProvider
from relay.providers.local.sandbox import LocalSandbox
from testing.host import uid_range
from tests.conftest import make_settings

needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root switches uids")
FIRST, _ = uid_range()
"""Of this run's own: another copy of the suite holds and runs as uids of its own."""


def test_numbers_within_a_quarter_of_the_file_table_stand() -> None:
    assert file_table.fit(4_000_000, 32, 128, 128) == file_table.FileBudget(128, 128)
    assert file_table.fit(None, 10**6, 128, 128) == file_table.FileBudget(128, 128)


def test_past_it_the_open_files_then_the_processes_are_lowered_with_one_line() -> None:
    # A quarter of 400,000 over 32 sandboxes is 3,125 files each.
    budget = file_table.fit(400_000, 32, 128, 128)
    assert (budget.pids, budget.open_files) == (48, 64)
    assert 32 * budget.pids * budget.open_files <= 100_000
    assert budget.lowered is not None and "fs.file-max (400,000)" in budget.lowered
    assert "48 processes of 64 open files" in budget.lowered
    only_files = file_table.fit(1_000_000, 32, 64, 256)
    assert (only_files.pids, only_files.open_files) == (64, 122)


def test_past_even_the_least_numbers_the_relay_does_not_start() -> None:
    with pytest.raises(ConfigError, match="RELAY_LOCAL_MAX_SANDBOXES: 1000 local sandboxes"):
        file_table.fit(400_000, 1000, 128, 128)


@needs_bwrap
async def test_the_provider_applies_a_lowered_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(file_table, "file_max", lambda: 400_000)
    with caplog.at_level(logging.WARNING, "relay.providers.local"):
        provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    try:
        [line] = [r.message for r in caplog.records if "fs.file-max" in r.message]
        assert "48 processes of 64 open files" in line
        assert provider.rlimits(10, 256)["nofile"] == (64, 64)
    finally:
        await provider.aclose()


@needs_bwrap
async def test_the_provider_runs_no_more_sandboxes_than_budgeted(tmp_path: Path) -> None:
    """A sandbox holds processes and files only while its command runs: one that waits
    (a pooled one) does not count, a second command at once is refused."""
    provider = LocalProvider(
        make_settings(tmp_path, local_isolation="bwrap", local_max_sandboxes=1)
    )

    async def run(box: Sandbox, argv: list[str]) -> int | None:
        result = await box.exec(
            argv, stdin=None, env={}, workdir=None, timeout_s=10, output=OutputSink(1024)
        )
        return result.exit_code

    try:
        async with (
            provider.sandbox(SandboxSpec("run_first", "test", 10)) as first,
            provider.sandbox(SandboxSpec("run_second", "test", 10)) as second,
        ):
            sleeping = asyncio.create_task(run(first, ["sleep", "2"]))
            while provider._commands == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(ProviderRateLimited, match=r"as it may at once \(1\)"):
                await run(second, ["true"])
            assert await sleeping == 0
        async with provider.sandbox(SandboxSpec("run_third", "test", 10)) as third:
            assert await run(third, ["true"]) == 0  # the place is free again
    finally:
        await provider.aclose()


def test_a_uid_is_held_by_one_relay_at_a_time_and_free_once_released() -> None:
    first, second = uids.UidRange(FIRST, FIRST + 1), uids.UidRange(FIRST, FIRST + 1)
    held = [first.take(), first.take()]
    assert {uid.uid for uid in held} == {FIRST, FIRST + 1}
    with pytest.raises(ProviderRateLimited):  # another relay on the host, the same range
        second.take()
    held[0].release()
    again = second.take()
    assert again.uid == held[0].uid
    for uid in (again, held[1]):
        uid.release()


def test_a_range_given_to_users_as_subordinate_ids_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nbob:730000100:65536\n")
    monkeypatch.setattr(uids, "SUBORDINATE_FILES", (subuid,))
    uids.check_free(uids.UidRange(730_000_000, 730_000_099))
    with pytest.raises(ConfigError, match="gives bob 730000100-730065635"):
        uids.check_free(uids.UidRange(730_000_000, 730_000_100))


def _running_as(uid: int) -> subprocess.Popen[bytes]:
    """A process running as ``uid`` (in no relay's sandbox group), once it does."""
    stranger = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"]
    )
    deadline = time.monotonic() + 5
    while Path(f"/proc/{stranger.pid}").stat().st_uid != uid:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return stranger


@needs_root
@needs_bwrap
async def test_a_uid_a_stray_process_runs_as_is_held_back_and_the_relay_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay killed outright may leave a sandbox process running as its uid (cgroups off:
    no group sweep finds it; or one that survived the sweep). The next relay used to refuse
    to start ("uid N is used by process P, which is no relay's sandbox"), so a job could
    stop every restart. It starts, says so in one line, and gives that uid to no sandbox
    while the process lives; once it is gone, the uid is given again."""
    first = FIRST + 400
    stranger = _running_as(first)
    try:
        settings = make_settings(
            tmp_path,
            local_isolation="bwrap",
            local_cgroups=False,
            local_uids=(first, first + 1),
            local_max_sandboxes=1,
            pool_max=0,
        )
        with caplog.at_level(logging.WARNING, "relay.providers.local"):
            provider = LocalProvider(settings)
        [line] = [r.getMessage() for r in caplog.records if "RELAY_LOCAL_UIDS" in r.getMessage()]
        assert f"({first})" in line and f"{stranger.pid} (sleep)" in line
        try:
            given = set()
            for number in range(4):  # the range's next uid rotates: each is tried
                async with provider.sandbox(SandboxSpec(f"run_u{number}", "test", 10)) as box:
                    result = await box.exec(
                        ["true"],
                        stdin=None,
                        env={},
                        workdir=None,
                        timeout_s=10,
                        output=OutputSink(64),
                    )
                    assert result.exit_code == 0
                    assert isinstance(box, LocalSandbox) and box.uid is not None
                    given.add(box.uid.uid)
                    with pytest.raises(ProviderRateLimited):  # not the stray's, even now
                        provider.uids.take()  # type: ignore[union-attr]
            assert given == {first + 1}
            stranger.kill()
            stranger.wait()
            held = [provider.uids.take() for _ in range(2)]  # type: ignore[union-attr]
            assert {uid.uid for uid in held} == {first, first + 1}
            for uid in held:
                uid.release()
        finally:
            await provider.aclose()
    finally:
        stranger.kill()
        stranger.wait()


@needs_root
def test_a_relay_that_is_not_root_names_who_else_shares_its_sandboxes_uid(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not root, the relay cannot switch uids: its sandboxes run as its own, which it
    should have to itself. A process sharing it is named in one warning line."""
    own = FIRST + 300
    sharer = _running_as(own)
    try:
        monkeypatch.setattr(os, "geteuid", lambda: own)
        with caplog.at_level(logging.WARNING, "relay.providers.local"):
            assert uids.for_sandboxes((FIRST, FIRST + 99), 8) is None
        [line] = [r.getMessage() for r in caplog.records]
        assert f"own uid {own}" in line and f"{sharer.pid} (sleep)" in line
    finally:
        sharer.kill()
        sharer.wait()
