"""Serve the fake by hand: ``python -m testing.fakes.sprites --port 8791``."""

from __future__ import annotations

import argparse
import contextlib
import threading

from testing.fakes.sprites.server import running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake Fly.io Sprites API on 127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    port = parser.parse_args().port
    with running_fake(port) as fake:
        print(f"fake Sprites API at {fake.url}", flush=True)
        print(f"set RELAY_SPRITES_BASE_URL={fake.url} and any RELAY_SPRITES_TOKEN", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
