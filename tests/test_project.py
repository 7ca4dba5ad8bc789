"""The project's habits hold: one version string, pre-commit runs what `make lint` runs."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

import yaml

import relay
from tests.conftest import REPO


def test_one_version_string() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == "relay/__init__.py"
    assert re.fullmatch(r"\d+\.\d+\.\d+", relay.__version__)
    assert version("sandbox-relay") == relay.__version__  # what pip installed says the same


def test_pre_commit_runs_what_make_lint_runs() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    lint = [line.strip().replace("$(BIN)/", ".venv/bin/") for line in recipe]
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [repo["repo"] for repo in config["repos"]] == ["local"]  # nothing fetched
    assert [hook["entry"] for hook in hooks] == lint
    assert all(hook["language"] == "system" for hook in hooks)


def test_mypy_checks_tests_and_bench() -> None:
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy["strict"] is True
    assert set(mypy["files"]) == {"relay", "tests", "bench", "testing"}
