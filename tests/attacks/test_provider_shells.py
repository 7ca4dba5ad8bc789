"""The shell lines the daytona and sprites providers build around a job's argv, run by a
real ``sh`` here: the argv runs exactly as given, whatever its words look like."""

from __future__ import annotations

import subprocess
from pathlib import Path

from relay.providers.daytona import command_line
from relay.providers.sprites import _WRAPPER

PROGRAM = "#!/bin/sh\nprintf '%s|' ran \"$@\"\nprintf '%s' \"$MODE\"\n"


def _program(folder: Path, name: str) -> None:
    path = folder / name
    path.write_text(PROGRAM)
    path.chmod(0o755)


def test_a_daytona_argv_whose_first_word_has_an_equals_sign_runs_as_given(tmp_path: Path) -> None:
    # `env -- NAME=VALUE... argv` would take "./run=me" for one more assignment and run
    # the next word instead.
    _program(tmp_path, "run=me")
    argv = ["./run=me", "echo", "not this", "$(id)"]
    line = command_line(argv, {"MODE": "a b"}, str(tmp_path), "/dev/null", 5)
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout) == (0, "ran|echo|not this|$(id)|a b")


def test_a_sprites_argv_runs_as_given(tmp_path: Path) -> None:
    _program(tmp_path, "run=me")
    argv = ["./run=me", "-s", "$(id)", "a'b", ""]
    done = subprocess.run(
        ["sh", "-c", _WRAPPER, "marker", "5", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin", "MODE": "m"},
    )
    assert (done.returncode, done.stdout) == (0, "ran|-s|$(id)|a'b||m")
