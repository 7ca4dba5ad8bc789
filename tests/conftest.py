"""Shared fixtures: clean environment, settings in a temp folder, tokens, relay servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.settings import Settings

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees the developer's RELAY_* variables or provider credentials."""
    for name in list(os.environ):
        if name.startswith(("RELAY_", "E2B_", "MODAL_", "VERCEL_")):
            monkeypatch.delenv(name, raising=False)
    yield


def make_settings(tmp_path: Path, **values: object) -> Settings:
    """Settings for a test: everything under tmp_path, no .env file read."""
    defaults: dict[str, object] = {
        "tokens_file": tmp_path / "tokens.toml",
        "jobs_dir": REPO / "jobs",
        "database_url": f"sqlite+aiosqlite:///{tmp_path / 'relay.db'}",
        "local_root": tmp_path / "sandboxes",
        "cluster": "test",
    }
    defaults.update(values)
    return Settings(_env_file=None, **defaults)  # type: ignore[call-arg]
