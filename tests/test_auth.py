"""Tokens: hashed at rest, checked against every entry, never failing open."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from pathlib import Path

import pytest

from relay.auth import TokenStore, hash_token, new_token, revoke_token, rotate_token
from relay.errors import ConfigError, NotFound, TokenExpired, Unauthorized


def test_token_file_holds_only_hashes(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    limits = {"max_timeout_s": 30, "max_artifact_bytes": 1 << 20}
    token = new_token(path, "ci", jobs=["echo"], limits=limits)
    text = path.read_text()
    assert token not in text
    assert hashlib.sha256(token.encode()).hexdigest() in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    principal = TokenStore(path).authenticate(token)
    assert principal.name == "ci" and principal.jobs == {"echo"} and not principal.command
    assert principal.max_timeout_s == 30 and principal.max_artifact_bytes == 1 << 20


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
        ("max_artifact_bytes = 0", "tokens.x.max_artifact_bytes: must be a positive number"),
        # nan passes every comparison's test: runs_per_day = nan was no limit at all
        ("runs_per_day = nan", "tokens.x.runs_per_day: must be a positive number"),
        ("usd_per_day = nan", "tokens.x.usd_per_day: must be a positive number"),
        ("max_artifact_bytes = inf", "tokens.x.max_artifact_bytes: must be a positive number"),
        # 0.5 bytes was a cap of 0 (every file skipped) and /v1/usage's limits a 500
        (
            "max_artifact_bytes = 0.5",
            "tokens.x.max_artifact_bytes: must be a positive whole number",
        ),
        ("max_concurrent = 1.5", "tokens.x.max_concurrent: must be a positive whole number"),
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


def test_a_rotated_tokens_old_value_works_for_its_overlap_then_is_refused_as_expired(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tokens.toml"
    old = new_token(path, "routine", jobs=["echo"])
    new = rotate_token(path, "routine", overlap_s=3600)
    store = TokenStore(path)
    assert store.authenticate(old) == store.authenticate(new)  # the same token, two values
    assert [p.name for p in store.principals] == ["routine"]
    assert store.holds_value(hash_token(old)) and store.holds_value(hash_token(new))
    # Rotated again an hour and a minute ago: that overlap is over, and the first value gone.
    newest = rotate_token(path, "routine", overlap_s=60, now=time.time() - 3660)
    store.refresh()
    with pytest.raises(TokenExpired, match=r"overlap ended at .*Z: use the token's new value"):
        store.authenticate(new)
    with pytest.raises(Unauthorized, match="unknown token"):
        store.authenticate(old)
    assert not store.holds_value(hash_token(new))
    assert store.authenticate(newest).name == "routine"
    assert TokenExpired.status == 401 and TokenExpired.code == "token_expired"


def test_an_expired_token_is_refused_and_a_rotation_must_renew_it(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    token = new_token(path, "short", expires_at=time.time() - 1)
    with pytest.raises(TokenExpired, match=r"the token expired at \d{4}-\d\d-\d\dT.*Z"):
        TokenStore(path).authenticate(token)
    with pytest.raises(ConfigError, match="--expires"):
        rotate_token(path, "short")
    renewed = rotate_token(path, "short", expires_at=time.time() + 86400)
    assert TokenStore(path).authenticate(renewed).expires_at is not None
    forever = rotate_token(path, "short", expires_at=None)
    assert TokenStore(path).authenticate(forever).expires_at is None
    assert "expires" not in path.read_text()


def test_the_listeners_hear_when_an_old_value_stops_being_valid_by_the_clock(
    tmp_path: Path,
) -> None:
    """No file change: the end of an overlap is a reload of sorts for what holds values (an
    /mcp session of the old value), heard at the first look after it."""
    path = tmp_path / "tokens.toml"
    old = new_token(path, "a")
    rotate_token(path, "a", overlap_s=0.3)
    store = TokenStore(path)
    heard: list[bool] = []
    store.on_reload(lambda: heard.append(store.holds_value(hash_token(old))))
    store.refresh()
    assert heard == [] and store.next_expiry is not None
    time.sleep(max(0.0, store.next_expiry - time.time()) + 0.05)
    store.refresh()
    store.refresh()
    assert heard == [False] and store.next_expiry is None


def test_uses_are_noted_in_memory_and_handed_over_once(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    token = new_token(path, "a")
    store = TokenStore(path)
    before = time.time()
    store.authenticate(token)
    store.authenticate(token)
    with pytest.raises(Unauthorized):
        store.authenticate("rly_unknown")
    taken = store.take_uses()
    assert list(taken) == [hash_token(token)]
    assert taken[hash_token(token)][0] == "a" and taken[hash_token(token)][1] >= before
    assert store.take_uses() == {}


def test_a_token_file_holding_a_webhook_secret_readable_by_all_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    new_token(path, "plain")
    path.chmod(0o644)
    assert TokenStore(path).exposed_secrets() is None  # hashes only
    new_token(path, "hooks", webhook_secret="whsec_c2VjcmV0")
    why = TokenStore(path).exposed_secrets()
    assert why is not None and str(path) in why and "chmod 600" in why and "0644" in why
    path.chmod(0o640)
    assert TokenStore(path).exposed_secrets() is None


def test_a_rewrite_keeps_the_files_mode_and_group(tmp_path: Path) -> None:
    """An operator's 0640 with the relay's group must survive `relay tokens rotate`, or the
    relay could no longer read the file it was given."""
    path = tmp_path / "tokens.toml"
    new_token(path, "a")
    os.chown(path, -1, 4242)
    path.chmod(0o640)
    rotate_token(path, "a", overlap_s=60)
    revoke_token(path, "a")
    found = path.stat()
    assert stat.S_IMODE(found.st_mode) == 0o640 and found.st_gid == 4242


def test_a_token_name_not_in_the_file_is_not_found(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    new_token(path, "one")
    with pytest.raises(NotFound, match="no token named 'two'; the tokens are: one"):
        rotate_token(path, "two")
