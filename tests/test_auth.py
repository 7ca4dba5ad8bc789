"""Tokens: hashed at rest, checked against every entry, never failing open."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

import pytest

from relay.auth import TokenStore, hash_token, new_token, rotate_token
from relay.errors import ConfigError, Unauthorized


def test_token_file_holds_only_hashes(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    token = new_token(path, "ci", jobs=["echo"], limits={"max_timeout_s": 30})
    text = path.read_text()
    assert token not in text
    assert hashlib.sha256(token.encode()).hexdigest() in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    principal = TokenStore(path).authenticate(token)
    assert principal.name == "ci" and principal.jobs == {"echo"} and not principal.command
    assert principal.max_timeout_s == 30


def test_unknown_missing_and_near_miss_tokens_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    token = new_token(path, "a")
    store = TokenStore(path)
    for bad in (None, "", token[:-1], token + "x", token.upper()):
        with pytest.raises(Unauthorized):
            store.authenticate(bad)


def test_no_token_file_or_no_token_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no token file"):
        TokenStore(tmp_path / "missing.toml")
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no token configured"):
        TokenStore(empty)


def test_a_new_token_works_without_restart(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    new_token(path, "first")
    store = TokenStore(path)
    second = new_token(path, "second")
    os.utime(path, (1, 1))  # make sure the change is seen even within one mtime tick
    assert store.authenticate(second).name == "second"


def test_duplicate_and_bad_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    new_token(path, "one")
    with pytest.raises(ConfigError, match="exists"):
        new_token(path, "one")
    with pytest.raises(ConfigError):
        new_token(path, "Bad Name")


def test_bad_entries_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text('[tokens.x]\nsha256 = "abc"\n')
    with pytest.raises(ConfigError, match=r"tokens\.x\.sha256"):
        TokenStore(path)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ('job = ["echo"]', "tokens.x.job: unknown key (did you mean 'jobs'?)"),
        ("max_timout_s = 5", "tokens.x.max_timout_s: unknown key (did you mean 'max_timeout_s'?)"),
        ('command = "no"', "tokens.x.command: must be true or false"),
        ("max_concurrent = true", "tokens.x.max_concurrent: must be a positive number"),
        ("webhook_secret = 5", "tokens.x.webhook_secret: must be a non-empty string"),
    ],
)
def test_a_typo_or_a_wrong_type_never_widens_a_token(tmp_path: Path, line: str, named: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens.x]\nsha256 = "{"0" * 64}"\n{line}\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {named}")):
        TokenStore(path)


def test_an_unknown_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'[token.x]\nsha256 = "{"0" * 64}"\n')
    with pytest.raises(ConfigError, match=re.escape("token: unknown key (did you mean 'tokens'?)")):
        TokenStore(path)


def test_a_reload_tells_what_holds_token_values_which_are_still_in_use(tmp_path: Path) -> None:
    """What keeps a token's value (an /mcp session) hears of each reload of a changed file,
    and of the file going, to let go of values no longer in it; a reload that fails keeps the
    last good tokens and tells nothing."""
    path = tmp_path / "tokens.toml"
    old = new_token(path, "a")
    store = TokenStore(path)
    heard: list[tuple[bool, bool]] = []
    values = [hash_token(old)]
    store.on_reload(
        lambda: heard.append((store.holds_value(values[0]), store.holds_value(values[-1])))
    )
    store.refresh()
    assert heard == []  # unchanged
    values.append(hash_token(rotate_token(path, "a")))
    store.refresh()
    assert heard == [(False, True)]
    path.write_text("[tokens.a\n")
    store.refresh()
    assert heard == [(False, True)]
    path.unlink()
    store.refresh()
    store.refresh()
    assert heard == [(False, True), (False, False)]
