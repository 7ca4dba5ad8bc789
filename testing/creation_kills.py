"""Relays killed outright while they create local sandboxes, many times, none restarted.

    python -m testing.creation_kills ROOT SEED KILLS PREFIX [UIDS]

Builds a local provider (bubblewrap) on the sandbox root ``ROOT``, then ``KILLS`` times
forks a relay of it: the child starts creating sandboxes at once (a few at a time, each
running ``sleep 30``, one after another) and is killed with ``SIGKILL`` at a moment drawn
from ``SEED`` while some sandbox is somewhere in its creation. The run ids start with
``run_PREFIX`` (the sandbox ids with ``lcl-PREFIX``), so whoever counts what is left
(tests/providers/test_local_creation_kills.py) finds this harness's sandboxes alone, by
their marker. ``UIDS`` (``FIRST-LAST``) is the range a root relay gives them. Prints one
line per kill (its moment) and exits once every relay is reaped; nothing is cleaned up.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

from relay.providers.contract import OutputSink, SandboxSpec
from relay.providers.local.provider import LocalProvider
from testing.settings import make_settings

AT_ONCE = 4
LATEST_KILL_S = 0.25
"""Kills land within this long of the relay's start: a sandbox's creation takes tens of
milliseconds, and the first ones start at once."""


async def _create_forever(provider: LocalProvider, prefix: str, lane: int) -> None:
    for number in range(1_000_000):
        spec = SandboxSpec(f"run_{prefix}{lane}x{number}", "test", timeout_s=60, grace_s=5)
        async with provider.sandbox(spec) as box:
            await box.exec(
                ["sleep", "30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=60,
                output=OutputSink(64),
            )


async def _relay(provider: LocalProvider, prefix: str) -> None:
    await asyncio.gather(*(_create_forever(provider, prefix, lane) for lane in range(AT_ONCE)))


def main(argv: list[str]) -> int:
    root, seed, kills, prefix = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    uids = tuple(int(part) for part in argv[4].split("-")) if len(argv) > 4 else None
    values: dict[str, object] = {"local_isolation": "bwrap", "local_root": root}
    if uids is not None:
        values["local_uids"] = uids
    provider = LocalProvider(make_settings(root.parent, **values))
    rng = random.Random(seed)
    for kill in range(kills):
        moment = rng.uniform(0.0, LATEST_KILL_S)
        child = os.fork()
        if child == 0:  # the relay: creates until it is killed
            try:
                asyncio.run(_relay(provider, f"{prefix}k{kill}"))
            finally:
                os._exit(1)
        time.sleep(moment)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        print(f"killed relay {kill} after {moment * 1000:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
