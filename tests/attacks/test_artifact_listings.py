"""A sandbox's file API answers what the job in it made of it: on a cloud provider the job
is root in the VM that serves that API, so a listing can name anything. The walk
(relay/providers/collection.py) must never turn a listed name into an artifact that names a
folder above it (``..``) or the folder itself (``.``): its download URL would resolve
elsewhere in any client (``/v1/runs/ID/artifacts/out/..`` is ``/v1/runs/ID/artifacts/``),
and a path made from it would climb out of the folder read.

The hostile file API cannot run here, so its answers are given by a sandbox object that
lists exactly them (the one stub in these attacks). Names and folders a job makes itself
go through the local provider with real bubblewrap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from relay.providers.collection import SPENT, found_files
from relay.providers.contract import FileEntry
from relay.runs.models import RunRequest
from tests.providers.test_local_artifacts import _run


class _Listing:
    """A sandbox whose file API lists ``entries`` in every folder it is asked for."""

    def __init__(self, entries: list[FileEntry]) -> None:
        self.entries = entries
        self.listed: list[str] = []

    async def list_folder(self, path: str) -> list[FileEntry]:
        self.listed.append(path)
        return self.entries

    async def read_file(
        self, path: str, limit: int, size: int | None = None
    ) -> AsyncIterator[bytes]:
        raise AssertionError(f"nothing is read while listing: {path}")
        yield b""


async def test_a_listing_that_names_dot_or_dot_dot_never_gives_an_artifact_above_its_folder() -> (
    None
):
    sandbox = _Listing(
        [FileEntry("..", "file", 3), FileEntry(".", "file", 1), FileEntry("..", "folder")]
    )
    found = [
        entry
        async for entry in found_files(
            sandbox,  # type: ignore[arg-type]
            [".*", "out/.*", "*/x"],
            workdir=None,
            max_files=10,
        )
    ]
    to_read = [entry for entry in found if entry.skipped is None]
    assert to_read == [], to_read
    assert all(".." not in entry.name.split("/") for entry in found if entry.path), found
    assert "/workspace/.." not in sandbox.listed and "/workspace/." not in sandbox.listed


async def test_a_name_that_reorders_its_own_text_is_never_an_artifact(tmp_path: Path) -> None:
    # "invoice\u202egnp.exe" shows as "invoiceexe.png" wherever it is drawn (the console's
    # table, a download's file name): a program dressed as a picture.
    script = "mkdir -p out && printf 'MZ' > \"out/$(printf 'invoice\\342\\200\\256gnp.exe')\""
    run, kept = await _run(tmp_path, script, ["out/*"])
    [entry] = run.artifacts
    assert entry.sha256 is None and kept == b""
    assert entry.skipped == "its name has characters that reorder text"
    assert "\u202e" not in entry.name


async def test_a_declared_file_in_a_folder_of_many_files_is_found(tmp_path: Path) -> None:
    # tmpfs lists a folder newest first: the report comes after 5,000 names (~100 KiB).
    script = (
        'echo kept > report.json && seq -f "%06g-padding-to-make-the-name-long" 5000 | xargs touch'
    )
    run, kept = await _run(tmp_path, script, ["report.json"])
    [entry] = run.artifacts
    assert entry.skipped is None and kept == b"kept\n", entry


@pytest.mark.slow  # walks a million names: seconds of CPU
async def test_a_walk_over_a_million_names_stops_listing_at_its_bound() -> None:
    """A job's folders can hold millions of names (hard links cost its tmpfs nothing), and
    the walk holds every listing until it ends: each folder here lists 60,000 folders."""
    wide = [FileEntry(f"{number:06}", "folder") for number in range(60_000)]

    class _Wide(_Listing):
        async def list_folder(self, path: str) -> list[FileEntry]:
            assert len(self.listed) < 5, "the walk went on listing past its bound"
            return await super().list_folder(path)

    sandbox = _Wide(wide)
    found = [
        entry
        async for entry in found_files(
            sandbox,  # type: ignore[arg-type]
            ["*/*/report.json"],
            workdir=None,
            max_files=10,
        )
    ]
    assert len(sandbox.listed) == 2  # the root, then one folder cut at the bound
    assert [entry.skipped for entry in found] == [SPENT]


@pytest.mark.parametrize(
    "pattern", ["out/invoice\u202egnp.exe", "out/a\nb.txt", "out/\x1b[31mred", "out/x\u200ey"]
)
def test_a_declared_path_with_a_name_no_listing_may_give_is_refused(pattern: str) -> None:
    # Matching nothing, a pattern is an entry's name: shown as a listed one would be.
    with pytest.raises(ValidationError, match="cannot be an artifact's"):
        RunRequest(command=["true"], artifacts=[pattern])
