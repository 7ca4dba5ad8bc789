"""``python -m testing.fakes.modal --port P``: serve the fake Modal until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import threading

from testing.fakes.modal import running_fake


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with running_fake(args.host, args.port) as fake:
        print(f"fake Modal serving at {fake.url}", flush=True)
        print(f"point a relay at it: RELAY_MODAL_SERVER_URL={fake.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
