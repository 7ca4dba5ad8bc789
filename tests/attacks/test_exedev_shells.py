"""The exe.dev provider's scripts (relay/providers/exedev/scripts.py), run by a real ``sh``
here: a job's argv runs exactly as given, its variables (named like the scripts' own, too)
join the default environment and change nothing of the scripts, and its stdin, output and
exit status come back as they were."""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path

from relay.providers.exedev.scripts import FOLLOW, MONITOR, START
from relay.providers.lifecycle import variables_file

PROGRAM = (
    '#!/bin/sh\nprintf \'%s|\' ran "$@"\nprintf \'%s|%s|%s|\' "$MODE" "$KEPT" "$d"\ncat\nexit 7\n'
)
VALUE = "a b $(id) `id` 'q' \"d\"\nline"
DEFAULT = {"PATH": "/usr/bin:/bin", "KEPT": "k"}
"""The VM's default environment, as the scripts find it."""


def test_a_job_runs_as_given_detached_and_is_followed_to_its_exit(tmp_path: Path) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    (work / "run=me").write_text(PROGRAM)
    (work / "run=me").chmod(0o755)
    folder = tmp_path / "run"
    # Variables named as the scripts' own: none of them may steer the scripts.
    variables = variables_file({"MODE": VALUE, "d": "/elsewhere", "W": "/", "e": "x", "t": "y"})
    argv = ["./run=me", "-s", "$(id)", "a'b", ""]
    inputs = [base64.b64encode(data).decode() for data in (variables, b"in\r\nput")]
    started = subprocess.run(
        ["sh", "-c", START, "relay-start", str(folder), *inputs, MONITOR, str(work), "5", *argv],
        capture_output=True,
        timeout=10,
        env=DEFAULT,
        check=False,
    )
    assert (started.returncode, started.stdout, started.stderr) == (0, b"", b"")
    deadline = time.monotonic() + 10
    while not (folder / "exit").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    followed = subprocess.run(
        ["sh", "-c", FOLLOW, "relay-follow", str(folder), "0", "0"],
        capture_output=True,
        timeout=10,
        env=DEFAULT,
        check=False,
    )
    expected = f"ran|-s|$(id)|a'b||{VALUE}|k|/elsewhere|in\r\nput".encode()
    assert (followed.returncode, followed.stdout, followed.stderr) == (7, expected, b"")
    assert not (folder / "env").exists()  # read, then deleted before the job started
    # Followed again from where a broken stream stopped: the rest, exactly.
    rest = subprocess.run(
        ["sh", "-c", FOLLOW, "relay-follow", str(folder), str(len(expected) - 4), "end"],
        capture_output=True,
        timeout=10,
        env=DEFAULT,
        check=False,
    )
    assert (rest.returncode, rest.stdout) == (7, b"\nput")
