"""A local sandbox whose cleanup fails: logged and left to the reaper, never in place of the
run's own error (the same rule the base lifecycle gives every other provider)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from relay.errors import ProviderError, SandboxLost
from relay.providers.contract import OutputSink, SandboxSpec
from relay.providers.local import cgroups
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.provider import LocalProvider
from tests.conftest import make_settings

needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working")


async def test_a_failed_cleanup_does_not_replace_the_runs_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation="none"))
    spec = SandboxSpec(run_id="run_stuck", cluster="test", timeout_s=5)
    pinned: Path | None = None
    try:
        with pytest.raises(RuntimeError, match="the job's own failure"):
            async with provider.sandbox(spec) as box:
                # A mount inside the sandbox's folder: removing the folder fails (EBUSY).
                pinned = provider.root / box.id / "work"
                subprocess.run(["mount", "-t", "tmpfs", "none", str(pinned)], check=True)
                raise RuntimeError("the job's own failure")
        assert any("terminate failed" in record.getMessage() for record in caplog.records)
        assert [ref.run_id for ref in await provider.list_owned()] == ["run_stuck"]
        # Once the cause is gone, the reaper's terminate finishes the job.
        subprocess.run(["umount", str(pinned)], check=True)
        pinned = None
        await provider.terminate(box.id)
        assert await provider.list_owned() == []
    finally:
        if pinned is not None:
            subprocess.run(["umount", str(pinned)], check=False)
        await provider.aclose()


async def test_a_failed_cleanup_is_raised_when_nothing_else_failed(tmp_path: Path) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation="none"))
    pinned: Path | None = None
    try:
        with pytest.raises(ProviderError):
            async with provider.sandbox(SandboxSpec("run_ok", "test", 5)) as box:
                pinned = provider.root / box.id / "work"
                subprocess.run(["mount", "-t", "tmpfs", "none", str(pinned)], check=True)
    finally:
        if pinned is not None:
            subprocess.run(["umount", str(pinned)], check=False)
        await provider.aclose()


class RefusingTree(cgroups.CgroupTree):
    """A cgroup tree (of plain folders) that refuses to create a group, as a full or
    misconfigured cgroupfs does, after the sandbox's folder and tags exist."""

    def create(self, sandbox_id: str, limits: cgroups.GroupLimits) -> cgroups.SandboxGroup:
        raise OSError(28, "No space left on device")


async def test_a_create_that_fails_halfway_leaves_nothing(tmp_path: Path) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation="none"))
    parents = {"memory": tmp_path / "cgroup"}
    parents["memory"].mkdir()
    provider.tree = RefusingTree(parents, "v1")
    try:
        with pytest.raises(ProviderError, match="cgroup"):
            async with provider.sandbox(SandboxSpec("run_half", "test", 5)):
                pass
        assert list(provider.root.iterdir()) == []  # no folder, no tags, no lock left
        assert await provider.list_owned() == []
    finally:
        provider.tree = None
        await provider.aclose()


@needs_bwrap
async def test_a_sandbox_terminated_by_another_relay_mid_run_is_sandbox_lost(
    tmp_path: Path,
) -> None:
    """Another replica's reaper (or `relay reap`) ending a sandbox under a running command:
    the run learns its sandbox was lost, not that the job exited 137."""
    settings = make_settings(tmp_path, local_isolation="bwrap")
    provider, other = LocalProvider(settings), LocalProvider(settings)
    started = time.monotonic()
    try:
        with pytest.raises(SandboxLost):
            async with provider.sandbox(SandboxSpec("run_lost", "test", 30)) as box:

                async def reap_soon() -> None:
                    await asyncio.sleep(0.5)
                    await other.terminate(box.id)

                reaping = asyncio.create_task(reap_soon())
                await box.exec(
                    ["sh", "-c", "echo started; sleep 30"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=30,
                    output=OutputSink(100),
                )
                await reaping
        assert time.monotonic() - started < 10
        await reaping  # the other relay's terminate has ended,
        await provider.aftercare.finish(30)  # and this relay's own, where it went on aside
        assert await provider.list_owned() == []
    finally:
        await other.aclose()
        await provider.aclose()


def test_the_create_timeout_setting_bounds_a_local_create(tmp_path: Path) -> None:
    """RELAY_CREATE_TIMEOUT_S bounds a local create as it does every provider's (the base's
    ``created``); before, local kept the base's 60 s whatever the setting said."""
    provider = LocalProvider(make_settings(tmp_path, local_isolation="none", create_timeout_s=7))
    assert provider.create_timeout_s == 7
