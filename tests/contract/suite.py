"""The provider contract (design §4) as an abstract suite every provider joins.

:class:`ProviderContract` holds every test; a provider joins with one class in its own
``test_<name>.py`` that inherits it (and :class:`~tests.contract.fault_suite.FaultContract`
where its rig has fault switches) and names its rig (``testing/rigs``), the fsspec way:

    class TestE2B(ProviderContract, FaultContract, rig="e2b"):
        '''The contract on E2B.'''

``variant="none"`` runs it on one of the rig's variants (``test_local_none.py``). Each test
asserts something a user would notice: the command's result, and that no sandbox is left
alive afterwards (:func:`checked` reads the ground truth after each test).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import ClassVar

import pytest

from relay.errors import EgressUnsupported
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    ExecResult,
    OutputSink,
    SandboxSpec,
)
from relay.providers.lifecycle import SandboxProvider
from testing.rigs import RIGS
from tests.contract.harness import Harness, open_harness


def spec(harness: Harness, run_id: str = "run_contract", timeout_s: float = 20.0) -> SandboxSpec:
    return SandboxSpec(
        run_id=run_id,
        cluster="test",
        timeout_s=timeout_s,
        grace_s=10,
        image=harness.image,
        egress=Egress(("*",)),
    )


@contextlib.asynccontextmanager
async def checked(opening: AbstractAsyncContextManager[Harness]) -> AsyncIterator[Harness]:
    """A provider's harness, then the proof that no sandbox outlived the test."""
    async with opening as opened:
        yield opened
        if opened.faults is not None:
            opened.faults.clear()  # a fault left armed must not break the fake's own shutdown
        assert await opened.alive() == set(), "a sandbox outlived its test"


async def run(
    harness: Harness, argv: list[str], limit: int = 65536, **kwargs: object
) -> tuple[ExecResult, OutputSink]:
    sink = OutputSink(limit)
    options = {"stdin": None, "env": {}, "workdir": None, "timeout_s": 20.0} | kwargs
    async with harness.provider.sandbox(spec(harness)) as box:
        if "files" in options:
            await box.upload(options.pop("files"))  # type: ignore[arg-type]
        result = await box.exec(argv, output=sink, **options)  # type: ignore[arg-type]
    return result, sink


class ProviderContract:
    """Every test of the contract; a subclass per provider names its rig (and a variant)."""

    rig: ClassVar[str]
    """The provider's name, the key of its rig in ``testing.rigs.RIGS``."""
    variant: ClassVar[str | None] = None
    """One of the rig's variants, or ``None`` for the rig as it starts."""

    def __init_subclass__(
        cls, rig: str | None = None, variant: str | None = None, **kwargs: object
    ) -> None:
        super().__init_subclass__(**kwargs)
        if rig is not None:
            cls.rig, cls.variant = rig, variant

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(RIGS[self.rig], tmp_path, self.variant)) as opened:
            yield opened

    async def test_runs_a_command_and_terminates(self, harness: Harness) -> None:
        result, sink = await run(harness, ["echo", "hello", "world"])
        assert result.exit_code == 0
        assert sink.text("stdout") == "hello world\n"
        assert await harness.alive() == set()

    async def test_reports_a_non_zero_exit(self, harness: Harness) -> None:
        result, sink = await run(harness, ["sh", "-c", "echo oops >&2; exit 3"])
        assert result.exit_code == 3
        assert sink.text("stderr") == "oops\n"

    async def test_argv_is_never_a_shell_line(self, harness: Harness) -> None:
        result, sink = await run(harness, ["echo", "$HOME; echo pwned `id`"])
        assert sink.text("stdout") == "$HOME; echo pwned `id`\n"

    async def test_stdin_reaches_the_command(self, harness: Harness) -> None:
        result, sink = await run(harness, ["cat"], stdin=b"line one\nline two\n")
        assert sink.text("stdout") == "line one\nline two\n"

    async def test_only_the_given_env_reaches_the_job(self, harness: Harness) -> None:
        result, sink = await run(harness, ["env"], env={"GREETING": "hi there"})
        out = sink.text("stdout")
        assert "GREETING=hi there" in out.splitlines()
        assert "RELAY_" not in out and "PYTEST" not in out

    async def test_uploaded_files_are_readable_in_the_workdir(self, harness: Harness) -> None:
        files = {"data/in.txt": b"payload\n", "top.txt": b"top\n"}
        result, sink = await run(harness, ["cat", "data/in.txt", "top.txt"], files=files)
        assert result.exit_code == 0
        assert sink.text("stdout") == "payload\ntop\n"

    async def test_workdir_is_honoured(self, harness: Harness) -> None:
        files = {"sub/marker": b"here\n"}
        result, sink = await run(harness, ["cat", "marker"], files=files, workdir="sub")
        assert sink.text("stdout") == "here\n"

    async def test_output_is_capped_per_stream(self, harness: Harness) -> None:
        # A file and the shell's cat and echo: every provider's sandbox has those (the
        # memory provider's built-ins included), so no provider skips this.
        files = {"big.txt": b"x" * 200_000}
        argv = ["sh", "-c", "cat big.txt; echo e >&2"]
        result, sink = await run(harness, argv, files=files, limit=1000)
        assert result.exit_code == 0
        assert sink.output("stdout") == b"x" * 1000
        assert sink.truncated("stdout") and not sink.truncated("stderr")
        assert sink.text("stderr") == "e\n"

    async def test_deadline_cancels_exec_and_terminates(self, harness: Harness) -> None:
        sink = OutputSink(1000)
        started = time.monotonic()
        async with harness.provider.sandbox(spec(harness)) as box:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    await box.exec(
                        ["sh", "-c", "echo begun; sleep 60"],
                        stdin=None,
                        env={},
                        workdir=None,
                        timeout_s=1.5,
                        output=sink,
                    )
            sandbox_id = box.id
        assert time.monotonic() - started < 15
        assert sink.text("stdout") == "begun\n"
        assert sandbox_id not in await harness.alive()

    async def test_an_error_inside_the_context_still_terminates(self, harness: Harness) -> None:
        with pytest.raises(RuntimeError):
            async with harness.provider.sandbox(spec(harness)) as box:
                assert box.id in await harness.alive()
                raise RuntimeError("the caller failed")
        assert await harness.alive() == set()

    async def test_cancelling_the_task_still_terminates(self, harness: Harness) -> None:
        entered = asyncio.Event()

        async def runner() -> None:
            async with harness.provider.sandbox(spec(harness)) as box:
                entered.set()
                await box.exec(
                    ["sleep", "60"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=60,
                    output=OutputSink(100),
                )

        task = asyncio.create_task(runner())
        await asyncio.wait_for(entered.wait(), 30)
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await harness.alive() == set()

    async def test_created_with_its_own_lifetime_and_tags(self, harness: Harness) -> None:
        async with harness.provider.sandbox(spec(harness, "run_tagged", timeout_s=42)) as box:
            lifetime = await harness.lifetime_of(box.id)
            tags = await harness.tags_of(box.id)
            owned = await harness.provider.list_owned()
        assert lifetime is not None and 42 + 10 <= lifetime <= 42 + 10 + harness.lifetime_slack_s
        assert tags[TAG_CLUSTER] == "test" and tags[TAG_RUN] == "run_tagged"
        assert any(ref.sandbox_id == box.id and ref.run_id == "run_tagged" for ref in owned)

    async def test_terminate_is_idempotent(self, harness: Harness) -> None:
        async with harness.provider.sandbox(spec(harness)) as box:
            await harness.provider.terminate(box.id)
            await harness.provider.terminate(box.id)
        await harness.provider.terminate(box.id)
        assert box.id not in await harness.alive()
        assert all(ref.sandbox_id != box.id for ref in await harness.provider.list_owned())

    async def test_host_allow_list_is_enforced_or_refused(self, harness: Harness) -> None:
        hosts = SandboxSpec(
            run_id="run_x", cluster="test", timeout_s=5, egress=Egress(("example.com",))
        )
        try:
            harness.provider.check(hosts)
        except EgressUnsupported as exc:
            assert exc.status == 422

    async def test_cancelling_during_terminate_still_terminates(self, harness: Harness) -> None:
        """A second cancel (a DELETE during the final terminate) must not abandon it."""
        started = asyncio.Event()

        async def runner() -> None:
            async with harness.provider.sandbox(spec(harness)) as box:
                started.set()
                await box.exec(
                    ["true"], stdin=None, env={}, workdir=None, timeout_s=20, output=OutputSink(9)
                )
                # Lands at the terminate's first wait, as the context is left.
                asyncio.get_running_loop().call_soon(task.cancel)

        task = asyncio.create_task(runner())
        await asyncio.wait_for(started.wait(), 30)
        while not task.done():
            await asyncio.sleep(0.005)
            task.cancel()  # and again, for as long as the terminate runs
        provider = harness.provider
        if isinstance(provider, SandboxProvider) and (
            type(provider).destroy_now is not SandboxProvider.destroy_now
        ):  # its terminate answers without waiting: no cancellation can land in it
            await task
        else:
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await harness.alive() == set()
