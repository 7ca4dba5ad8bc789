"""scripts/system-deps.sh (`make test` runs it first) beside another copy of itself: two
clones' `make test` on a host that lacks a package both run apt-get, which takes one at a time
(`apt-get update` refuses a held lock outright: exit 100, and `make test` stopped)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from testing.postgres import APT_LOCK
from testing.settings import REPO

SCRIPT = REPO / "scripts" / "system-deps.sh"
APT_GET = """#!/bin/sh
# A stand-in for apt-get: says when each call of each run begins and ends.
echo "$RUN begins $*" >> "$LOG"
/bin/sleep 0.5
echo "$RUN ends" >> "$LOG"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs only as root")
def test_two_runs_at_once_take_turns_with_apt(tmp_path: Path) -> None:
    tools = tmp_path / "bin"  # what the script uses, and none of the packages it checks for
    tools.mkdir()
    for name in ("ls", "id", "flock"):
        found = shutil.which(name)
        assert found is not None, name
        (tools / name).symlink_to(found)
    (tools / "apt-get").write_text(APT_GET)
    (tools / "apt-get").chmod(0o755)
    log = tmp_path / "apt.log"
    runs = [
        subprocess.Popen(
            ["/bin/bash", str(SCRIPT)],
            env={"PATH": str(tools), "RUN": run, "LOG": str(log)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in ("a", "b")
    ]
    for run in runs:
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
    lines = log.read_text().splitlines()
    assert len(lines) == 8, lines
    first, second = lines[0][0], lines[4][0]
    assert {first, second} == {"a", "b"}
    # One run's update and install, then the other's: never two at once.
    turns = [[run, step] for run in (first, second) for step in ("begins", "ends") * 2]
    assert [line.split()[:2] for line in lines] == turns, lines
    install = lines[2].split(" ", 2)[2]
    assert install.startswith("-o DPkg::Lock::Timeout=") and " install " in install, install
    assert f"exec 9>{APT_LOCK}" in SCRIPT.read_text()  # testing/postgres.py takes the same turn
