"""``python -m testing.fakes.e2b --port P``: serve the fake until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading

from testing.fakes.e2b import running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with running_fake(args.host, args.port) as fake:
        print(f"fake E2B at {fake.url}", flush=True)
        print(f"RELAY_E2B_API_URL={fake.url} RELAY_E2B_SANDBOX_URL={fake.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    # Leaving the block killed every sandbox and subprocess the fake started.


if __name__ == "__main__":
    main()
