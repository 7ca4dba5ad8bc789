"""A protocol-level fake of the Fly.io Sprites API, for the real ``sprites-py`` SDK.

Follows: the Sprites public API docs as summed up in ``shared/reference/sprites.md``
(its 2026-12-01 correction included) for what the server answers, and ``sprites-py``
0.7.2 (the version the relay pins) for the wire the SDK speaks. It answers as the docs
say, not as the adapter might wish: a list item is ``{name, org_slug, updated_at}`` only
(labels come from a get), ``max_results`` outside 1 to 50 is a 400, an exec's ``env``
*replaces* the default environment, network rules apply first-match, unknown names are
404, and nothing ever deletes a sprite but ``DELETE``. ``tests/fakes/test_sprites_documented.py``
checks those shapes.

It speaks the REST calls and the exec WebSocket that ``sprites`` 0.7.2 uses (create, get,
list by prefix, delete, network policy, file write and read (``GET …/fs/read``), exec
with its binary stream frames, the session list and attach), runs each command as a real local process in a private
directory per sprite, keeps a ledger and injects faults::

    from testing.fakes.sprites import running_fake
    with running_fake() as fake:
        settings = Settings(sprites_base_url=fake.url, sprites_token="t", ...)
        fake.ledger.alive()          # sprites not deleted
        fake.faults.create_status = 429

Any bearer token is accepted except ``bad-key`` (answers 401). Sprites have no lifetime
(as on Fly): one lives until it is deleted. With bubblewrap, a policy under which no host
passes is enforced (private network namespace); an allow-list is checked by a proxy the
sprite's default environment names (:mod:`testing.fakes.sprites.network`).
"""

from testing.fakes.sprites.app import BAD_KEY, BODY_MARKER
from testing.fakes.sprites.server import FakeSprites, running_fake
from testing.fakes.sprites.world import Faults, Ledger

__all__ = ["BAD_KEY", "BODY_MARKER", "FakeSprites", "Faults", "Ledger", "running_fake"]
