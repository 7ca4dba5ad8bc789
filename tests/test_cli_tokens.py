"""`relay tokens` against a real relay: a rotation that keeps the old value for an overlap,
tokens that expire (401 token_expired, exit 3), last use without a write per request, scopes
checked when a token is made, webhook secrets in the Standard Webhooks form, and a token file
that holds one never readable by every user unnoticed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from relay.webhooks.dispatcher import signature_headers
from testing.relay_server import RelayProcess
from tests.test_cli import relay_cli

pytestmark = pytest.mark.slow  # needs a relay process: seconds

ECHO = {"job": "echo", "params": {"message": "x"}}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("tokens"), providers="memory")
    server.add_token("routine", jobs=["echo"])
    server.start()
    yield server
    server.stop()


def tokens(relay: RelayProcess, *args: str) -> tuple[int, str, str]:
    done = relay_cli("tokens", *args, cwd=relay.root, env=relay.env)
    return done.returncode, done.stdout, done.stderr


def call(relay: RelayProcess, token: str) -> tuple[int, str]:
    """`relay run echo` with ``token``: its exit code and its one error line."""
    env = {"RELAY_URL": relay.url, "RELAY_TOKEN": token}
    done = relay_cli("run", "echo", "-p", "message=x", cwd=relay.root, env=env)
    return done.returncode, done.stderr


def test_a_rotation_with_an_overlap_keeps_the_old_value_until_it_ends(relay: RelayProcess) -> None:
    """A routine's network secret is updated by a person, later: until the overlap ends both
    values run; then the old one is refused with a code that says why, and `relay run`
    exits 3 (auth) saying so."""
    old = relay.add_token("nightly", jobs=["echo"])
    # The overlap outlasts the two CLI starts and four requests below on a busy machine.
    code, new, told = tokens(relay, "rotate", "nightly", "--overlap", "6s")
    new = new.strip()
    assert code == 0 and new.startswith("rly_") and new != old
    assert "the old value of nightly works until" in told
    assert relay.post(old, ECHO).status_code == 200
    assert relay.post(new, ECHO).status_code == 200
    code, listed, _ = tokens(relay, "list")
    assert "nightly: its previous value is valid until" in listed
    code, listed, _ = tokens(relay, "list", "--json")
    (entry,) = [entry for entry in json.loads(listed) if entry["name"] == "nightly"]
    assert entry["previous_last_used_at"] is None  # not yet written: at most a minute old
    time.sleep(max(0.0, entry["previous_until"] - time.time()) + 0.2)
    refused = relay.post(old, ECHO)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "token_expired"
    assert "use the token's new value" in refused.json()["error"]["message"]
    assert refused.headers["www-authenticate"] == 'Bearer realm="relay", error="invalid_token"'
    code, error = call(relay, old)
    assert code == 3 and "token_expired" in error and error.count("\n") == 1
    assert call(relay, new)[0] == 0
    code, _, _ = tokens(relay, "rotate", "nightly")  # no overlap: the old value stops now
    assert code == 0 and relay.post(new, ECHO).status_code == 401


def test_a_token_expires(relay: RelayProcess) -> None:
    made = time.time()
    code, token, _ = tokens(relay, "new", "brief", "--job", "echo", "--expires", "4s")
    token = token.strip()
    assert code == 0 and relay.post(token, ECHO).status_code == 200
    code, listed, _ = tokens(relay, "list", "--json")
    (brief,) = [entry for entry in json.loads(listed) if entry["name"] == "brief"]
    assert made + 2 <= brief["expires_at"] <= time.time() + 5  # whole seconds, rounded up
    time.sleep(max(0.0, brief["expires_at"] - time.time()) + 0.2)
    assert relay.post(token, ECHO).json()["error"]["code"] == "token_expired"
    assert call(relay, token)[0] == 3
    code, _, told = tokens(relay, "rotate", "brief")
    assert code == 2 and "--expires" in told  # renewing it is said out loud
    code, renewed, _ = tokens(relay, "rotate", "brief", "--expires", "30d")
    assert code == 0 and relay.post(renewed.strip(), ECHO).status_code == 200
    code, _, told = tokens(relay, "new", "bad", "--expires", "soon")
    assert code == 2 and "not a duration" in told


def test_tokens_new_refuses_a_job_or_provider_that_does_not_exist(relay: RelayProcess) -> None:
    code, out, told = tokens(relay, "new", "typo", "--job", "nosuchjob")
    assert (code, out) == (2, "") and "--job nosuchjob: no such job" in told
    assert "echo" in told and "sleep" in told and told.count("\n") == 1
    code, _, told = tokens(relay, "new", "typo", "--provider", "e2bb")
    assert code == 2 and "--provider e2bb" in told and "e2b" in told
    assert "typo" not in relay.tokens_file.read_text()


def test_tokens_list_shows_last_use_which_costs_requests_no_write(tmp_path: Path) -> None:
    """Uses are noted in memory and written every minute and at shutdown: after a stop,
    `relay tokens list` says when each value was last used, and which never was."""
    relay = RelayProcess(tmp_path / "relay", providers="memory")
    used = relay.add_token("used", jobs=["echo"])
    relay.add_token("idle", jobs=["echo"])
    relay.start()
    try:
        before = time.time()
        for _ in range(3):
            assert relay.post(used, ECHO).status_code == 200
    finally:
        assert relay.stop() == 0
    code, listed, _ = tokens(relay, "list", "--json")
    found = {entry["name"]: entry for entry in json.loads(listed)}
    assert code == 0 and found["idle"]["last_used_at"] is None
    assert before - 1 <= found["used"]["last_used_at"] <= time.time()
    code, table, _ = tokens(relay, "list")
    header, *rows = table.splitlines()
    assert header.split()[:2] == ["NAME", "MAY"] and "LAST USED" in header
    used_row = next(row for row in rows if row.startswith("used "))
    assert "ago)" in used_row[header.index("LAST USED") :]
    assert "never" in next(row for row in rows if row.startswith("idle "))


def test_a_minted_webhook_secret_is_standard_and_verifies_as_is(relay: RelayProcess) -> None:
    """`Webhook(secret)` of the Standard Webhooks library verifies a delivery with the secret
    exactly as `relay tokens secret` prints it; `--new` gives the token another."""
    code, _, _ = tokens(relay, "new", "hooks", "--job", "echo", "--webhook-secret")
    code, secret, _ = tokens(relay, "secret", "hooks")
    secret = secret.strip()
    assert code == 0 and secret.startswith("whsec_") and len(secret) == 50
    body = b'{"id": "run_x"}'
    headers = signature_headers(secret, "dlv_1", body)
    assert Webhook(secret).verify(body, headers) == {"id": "run_x"}
    code, rotated, _ = tokens(relay, "secret", "hooks", "--new")
    rotated = rotated.strip()
    assert code == 0 and rotated.startswith("whsec_") and rotated != secret
    assert relay.tokens_file.read_text().count("webhook_secret = ") == 1
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, signature_headers(rotated, "dlv_2", body))
    code, _, told = tokens(relay, "secret", "nobody", "--new")
    assert code == 4 and "no token named 'nobody'" in told


def test_a_world_readable_token_file_holding_a_secret_is_one_warning(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path / "relay", providers="memory")
    relay.add_token("plain", jobs=["echo"])
    relay.add_token("hooks", jobs=["echo"], webhook_secret="whsec_c2VjcmV0LWtleQ==")
    relay.tokens_file.chmod(0o644)
    relay.start()
    relay.stop()
    warned = [line for line in relay.log().splitlines() if "readable by every user" in line]
    assert len(warned) == 1, relay.log()
    assert str(relay.tokens_file) in warned[0] and "chmod 600" in warned[0]
    assert json.loads(warned[0])["level"] == "warning"
    code, _, told = tokens(relay, "secret", "plain", "--new")
    assert code == 0 and "warning: " in told and "chmod 600" in told
