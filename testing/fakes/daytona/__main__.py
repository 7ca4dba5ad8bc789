"""Serve the fake by hand: ``python -m testing.fakes.daytona --port 8791``."""

from __future__ import annotations

import argparse
import contextlib
import threading

from testing.fakes.daytona.server import running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake Daytona API on 127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    port = parser.parse_args().port
    with running_fake(port) as fake:
        print(f"fake Daytona API at {fake.api_url}", flush=True)
        print(f"set RELAY_DAYTONA_API_URL={fake.api_url} and any RELAY_DAYTONA_API_KEY", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
