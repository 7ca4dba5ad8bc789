"""Serve the fake by hand: ``python -m testing.fakes.cloudflare --port 8792``."""

from __future__ import annotations

import argparse
import contextlib
import threading

from testing.fakes.cloudflare.server import KEY, running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake relay job Worker on 127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    port = parser.parse_args().port
    with running_fake(port) as fake:
        print(f"fake job Worker at {fake.url}", flush=True)
        print(f"its key: {KEY}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
