"""Settings for a test or a benchmark: everything under a temp folder, nothing read from the
environment's ``.env`` file."""

from __future__ import annotations

from pathlib import Path

from relay.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def make_settings(tmp_path: Path, **values: object) -> Settings:
    """Settings for a test: everything under tmp_path, no .env file read."""
    defaults: dict[str, object] = {
        "tokens_file": tmp_path / "tokens.toml",
        "jobs_dir": REPO / "jobs",
        "database_url": f"sqlite:///{tmp_path / 'relay.db'}",
        "local_root": tmp_path / "sandboxes",
        "cluster": "test",
    }
    defaults.update(values)
    url = str(defaults["database_url"])
    if not url.startswith("sqlite:///") or ":memory:" in url:
        # The relay's state goes beside its SQLite file; with no file (PostgreSQL, an
        # in-memory database) it would go to the working directory, the clone: not in a test.
        defaults.setdefault("state_dir", tmp_path)
    return Settings(_env_file=None, **defaults)  # type: ignore[call-arg]
