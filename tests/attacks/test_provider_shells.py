"""The shell lines the daytona and sprites providers build around a job's argv, run by a
real ``sh`` here: the argv runs exactly as given, whatever its words look like."""

from __future__ import annotations

import subprocess
from pathlib import Path

from relay.providers.daytona import command_line
from relay.providers.lifecycle import variables_file
from relay.providers.sprites import _WRAPPER

PROGRAM = '#!/bin/sh\nprintf \'%s|\' ran "$@"\nprintf \'%s|%s\' "$MODE" "$KEPT"\n'
VALUE = "a b $(id) `id` 'q' \"d\"\nline"


def _program(folder: Path, name: str) -> None:
    path = folder / name
    path.write_text(PROGRAM)
    path.chmod(0o755)


def _variables(folder: Path) -> Path:
    path = folder / "variables.env"
    path.write_bytes(variables_file({"MODE": VALUE}))
    return path


def test_a_daytona_argv_whose_first_word_has_an_equals_sign_runs_as_given(tmp_path: Path) -> None:
    # `env -- NAME=VALUE... argv` would take "./run=me" for one more assignment and run
    # the next word instead.
    _program(tmp_path, "run=me")
    argv = ["./run=me", "echo", "not this", "$(id)"]
    variables = _variables(tmp_path)
    line = command_line(argv, str(tmp_path), "/dev/null", 5, variables=str(variables))
    done = subprocess.run(
        ["sh", "-c", line],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin", "KEPT": "k"},
    )
    assert (done.returncode, done.stdout) == (0, f"ran|echo|not this|$(id)|{VALUE}|k")
    assert not variables.exists() and VALUE not in line


def test_a_sprites_argv_runs_as_given_with_its_variables_beside_the_default_ones(
    tmp_path: Path,
) -> None:
    _program(tmp_path, "run=me")
    argv = ["./run=me", "-s", "$(id)", "a'b", ""]
    variables = _variables(tmp_path)
    wrapper = _WRAPPER.replace("LIMIT", "5")
    done = subprocess.run(
        ["sh", "-c", wrapper, "marker", str(tmp_path), str(variables), *argv],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin", "KEPT": "k"},  # the sprite's default environment
    )
    assert (done.returncode, done.stdout) == (0, f"ran|-s|$(id)|a'b||{VALUE}|k")
    assert not variables.exists()
