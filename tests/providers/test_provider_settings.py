"""A provider's own settings: read from the same sources as the relay's, in the same order."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from relay import logs
from relay.providers.e2b import E2BSettings
from relay.providers.lifecycle import SandboxProvider
from relay.providers.modal import ModalSettings
from relay.providers.registry import PROVIDERS, load_provider
from relay.settings import Settings
from testing.rigs import RIGS
from tests.conftest import make_settings


def test_a_providers_section_reads_the_env_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RELAY_E2B_TEMPLATE", raising=False)
    (tmp_path / ".env").write_text("RELAY_E2B_TEMPLATE=from-file\nRELAY_MODAL_APP=ops\n")
    settings = Settings()
    assert settings.section(E2BSettings).template == "from-file"
    assert settings.section(ModalSettings).app == "ops"
    # A relay told to read no file reads none for its providers either.
    assert Settings(_env_file=None).section(E2BSettings).template == "base"  # type: ignore[call-arg]


def test_the_environment_beats_the_file_and_keywords_beat_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("RELAY_E2B_TEMPLATE=from-file\n")
    monkeypatch.setenv("RELAY_E2B_TEMPLATE", "from-env")
    assert Settings().section(E2BSettings).template == "from-env"
    given = Settings(e2b_template="given")  # type: ignore[call-arg]
    assert given.section(E2BSettings).template == "given"
    # A copy (``relay serve --port``) keeps what it was given.
    assert given.model_copy(update={"port": 9}).section(E2BSettings).template == "given"


def test_a_key_prints_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_E2B_API_KEY", "e2b_supersecret")
    section = Settings(_env_file=None).section(E2BSettings)  # type: ignore[call-arg]
    assert "supersecret" not in repr(section)
    assert section.api_key is not None and section.api_key.get_secret_value() == "e2b_supersecret"


def test_a_loaded_providers_keys_are_blanked_in_logs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    settings = Settings(_env_file=None, e2b_api_key="e2b_redact_me_7f1")  # type: ignore[call-arg]
    provider = load_provider("e2b", settings)
    try:
        logs.configure("info", "json")
        logging.getLogger("relay.providers.e2b").warning("the SDK said e2b_redact_me_7f1")
    finally:
        root.handlers[:], root.level = saved
        asyncio.run(provider.aclose())
    written = capsys.readouterr().err
    assert "e2b_redact_me_7f1" not in written and "[redacted]" in written


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_every_provider_takes_the_create_timeout_setting(tmp_path: Path, name: str) -> None:
    """RELAY_CREATE_TIMEOUT_S is the only bound on a create (the base lifecycle's
    ``created``; the run has no second one): a provider keeping the base's 60 s ignored it
    (local did)."""
    # Each provider's keys from its rig: enough to build it, nothing is reached.
    keys = RIGS[name].keys
    settings = make_settings(tmp_path, create_timeout_s=7, local_isolation="none", **keys)
    provider = load_provider(name, settings)
    try:
        assert isinstance(provider, SandboxProvider)
        assert provider.create_timeout_s == 7
    finally:
        asyncio.run(provider.aclose())
