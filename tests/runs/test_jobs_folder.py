"""The jobs folder a running relay follows (relay/runs/jobs_folder.py): a reload swaps the one
shared catalog whole, tells its followers only of a change, keeps the last good jobs when a
file does not load (saying which, within the folder), and the watch reloads on a change."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.errors import JobsInvalid
from relay.runs.catalog import Catalog
from relay.runs.jobs_folder import JobsFolder
from tests.conftest import make_settings


def write_job(jobs: Path, name: str, text: str = 'command = ["echo", "hi"]\n') -> None:
    (jobs / name).mkdir(parents=True, exist_ok=True)
    (jobs / name / "job.toml").write_text(text)


def folder(tmp_path: Path) -> tuple[JobsFolder, list[Catalog]]:
    jobs = tmp_path / "jobs"
    write_job(jobs, "jobs")  # a job named like its folder: its path must stay readable
    settings = make_settings(tmp_path, jobs_dir=jobs)
    told: list[Catalog] = []

    async def follower(catalog: Catalog) -> None:
        told.append(catalog)

    jobs_folder = JobsFolder(settings, Catalog.load(jobs))
    jobs_folder.follow(follower)
    return jobs_folder, told


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_a_reload_swaps_the_shared_catalog_and_tells_followers_of_changes_only(
    tmp_path: Path,
) -> None:
    jobs_folder, told = folder(tmp_path)
    shared = jobs_folder.catalog
    before = shared.jobs
    assert (await jobs_folder.reload()).changes is False
    assert told == [] and shared.jobs == before
    write_job(tmp_path / "jobs", "more")
    done = await jobs_folder.reload()
    assert done.added == ("more",) and done.jobs == ("jobs", "more")
    assert told == [shared] and set(shared.jobs) == {"jobs", "more"}
    assert set(before) == {"jobs"}  # a reader holding the old mapping still reads it whole


async def test_a_file_that_does_not_load_keeps_the_last_good_jobs_and_names_itself(
    tmp_path: Path,
) -> None:
    jobs_folder, told = folder(tmp_path)
    write_job(tmp_path / "jobs", "jobs", 'command = ["echo"]\nnope = 1\n')
    write_job(tmp_path / "jobs", "more")
    with pytest.raises(JobsInvalid) as refused:
        await jobs_folder.reload()
    assert refused.value.message == "jobs/job.toml: nope: unknown field"
    assert jobs_folder.problem == refused.value.message
    assert set(jobs_folder.catalog.jobs) == {"jobs"} and told == []
    write_job(tmp_path / "jobs", "jobs")
    await jobs_folder.reload()
    assert jobs_folder.problem is None and set(jobs_folder.catalog.jobs) == {"jobs", "more"}


async def test_the_watch_reloads_when_a_file_changes(tmp_path: Path) -> None:
    jobs_folder, told = folder(tmp_path)
    watching = asyncio.create_task(jobs_folder.watch_forever(0.05))
    try:
        await asyncio.sleep(0.1)
        write_job(tmp_path / "jobs", "more")
        await until(lambda: "more" in jobs_folder.catalog.jobs)
        write_job(tmp_path / "jobs", "more", "command = 1\n")
        await until(lambda: jobs_folder.problem is not None)
        assert "more" in jobs_folder.catalog.jobs  # the last good one serves on
        write_job(tmp_path / "jobs", "more", 'command = ["echo", "fixed"]\n')
        await until(lambda: jobs_folder.problem is None)
        assert jobs_folder.catalog.jobs["more"].command == ("echo", "fixed")
        assert len(told) == 2
    finally:
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching
