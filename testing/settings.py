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
        # The SQLite file's folder, said outright: a test on PostgreSQL or an in-memory
        # database would otherwise spool into the working directory (the clone).
        "state_dir": tmp_path,
    }
    defaults.update(values)
    return Settings(_env_file=None, **defaults)  # type: ignore[call-arg]
