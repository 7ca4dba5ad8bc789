"""Token values' last uses: noted in memory on a request's path, written once a minute and at
shutdown, each row only moving forward, on both engines."""

from __future__ import annotations

import contextlib

from relay.store import token_uses
from relay.store.database import Store
from relay.store.token_uses import TokenUseWriter


async def test_a_write_keeps_the_latest_use_of_each_value(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        noted = [{"a" * 64: ("ci", 100.0), "b" * 64: ("ci", 50.0)}, {}, {"a" * 64: ("ci", 90.0)}]
        writer = TokenUseWriter(store, lambda: noted.pop(0), interval_s=3600)
        await writer.write()
        await writer.write()  # nothing noted: nothing written
        # Another replica noted an older use of the same value: the later one stays.
        await writer.write()
        assert await store.read(token_uses.read) == {"a" * 64: 100.0, "b" * 64: 50.0}
        later = TokenUseWriter(store, lambda: {"b" * 64: ("ci", 70.0)})
        await later.write()
        assert await store.read(token_uses.read) == {"a" * 64: 100.0, "b" * 64: 70.0}
    finally:
        await store.close()


async def test_uses_a_failed_write_could_not_store_are_written_by_the_next() -> None:
    store = await Store.open("sqlite:///:memory:")
    noted = [{"c" * 64: ("ci", 10.0)}, {"d" * 64: ("ops", 20.0)}]
    writer = TokenUseWriter(store, lambda: noted.pop(0) if noted else {})
    await store.close()  # the next write fails
    with contextlib.suppress(Exception):  # whatever a closed store raises
        await writer.write()
    store = await Store.open("sqlite:///:memory:")
    writer.store = store
    try:
        await writer.write()
        assert await store.read(token_uses.read) == {"c" * 64: 10.0, "d" * 64: 20.0}
    finally:
        await store.close()
