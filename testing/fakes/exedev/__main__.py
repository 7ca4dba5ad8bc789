"""Serve the fake by hand: ``python -m testing.fakes.exedev --port 8792``."""

from __future__ import annotations

import argparse
import contextlib
import threading

from testing.fakes.exedev.server import running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake exe.dev HTTPS API on 127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    port = parser.parse_args().port
    with running_fake(port) as fake:
        print(f"fake exe.dev API at {fake.url} (POST {fake.url}/exec)", flush=True)
        print(
            "use any bearer token but bad-key: exedev.AsyncClient(token, base_url=URL)", flush=True
        )
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
