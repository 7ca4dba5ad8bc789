"""What a run costs the relay in PostgreSQL round trips (issue 42, item 2).

``python -m bench.round_trips`` drives the relay's ASGI app in process (as bench/extras.py
does: its middleware, routes, run service, the memory provider's ``noop`` job) on a
throwaway PostgreSQL (testing/postgres.py), and counts per run: the statements SQLAlchemy
sends, the pool checkouts, and the socket sends to PostgreSQL. The sends are counted on
asyncio's own selector loop, whose socket transport is Python and can be watched (uvloop's
is C); the relay sends the same messages on either loop. Runs go one at a time, then ten at a
time. Only what the runs themselves send is counted: a statement or a send is counted when
it is made in a run's context (the request's, which the run's own task inherits), not by the
relay's background work (its reaper, pruner, leases), whose timers may come due while the runs
go, more often the slower the machine. It prints; it writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import bench.extras as extras
from testing.postgres import start_postgres

_in_run: contextvars.ContextVar[bool] = contextvars.ContextVar("counted_run", default=False)
"""True in the runs' requests and in the tasks they start (a task copies its context)."""


async def count(url: str, runs: int) -> dict[str, Counter[str]]:
    """Statements, checkouts and sends per run, one at a time and ten at a time."""
    sends: Counter[str] = Counter()
    port = sa.engine.make_url(url).port
    transport_class: Any = asyncio.selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
    write = transport_class.write

    def counted_write(self: Any, data: Any) -> None:
        peer = self.get_extra_info("peername")
        if peer is not None and peer[1] == port and _in_run.get():
            sends["sends"] += 1
        write(self, data)

    figures: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory(prefix="relay-trips-") as folder:
        async with extras._relay(Path(folder), database_url=url) as (app, token):
            engine = app.state.relay.store.engine.sync_engine
            statements: Counter[str] = Counter()

            @sa.event.listens_for(engine, "before_cursor_execute")
            def _statement(*_: Any) -> None:
                if _in_run.get():
                    statements[_kind(_[2])] += 1

            @sa.event.listens_for(engine.pool, "checkout")
            def _checkout(*_: Any) -> None:
                if _in_run.get():
                    statements["(checkouts)"] += 1

            transport_class.write = counted_write
            try:
                for label, concurrency in (("one at a time", 1), ("ten at a time", 10)):
                    target = extras.Target(label, app, token)
                    await _rounds(target, 20, concurrency)  # warm up
                    statements.clear()
                    sends.clear()
                    await _rounds(target, runs, concurrency)
                    assert not target.refused, f"{target.refused} runs were not answered 200"
                    figures[label] = Counter(
                        {key: value / runs for key, value in (statements + sends).items()}
                    )
            finally:
                transport_class.write = write
    return figures


async def _rounds(target: extras.Target, runs: int, concurrency: int) -> None:
    marked = _in_run.set(True)  # gather's tasks, and the runs' own, copy it
    try:
        for _ in range(runs // concurrency):
            await asyncio.gather(*(target.post() for _ in range(concurrency)))
    finally:
        _in_run.reset(marked)


def _kind(statement: str) -> str:
    words = statement.split()
    first = words[0].upper() if words else "?"
    if first == "SELECT" and "advisory" in statement:
        return "SELECT pg_advisory_xact_lock"
    return first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.round_trips", description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    with start_postgres() as url:
        figures = asyncio.run(count(url, args.runs))  # the selector loop: sends are countable
    kinds = sorted({key for counted in figures.values() for key in counted})
    print("| per run | " + " | ".join(figures) + " |")
    print("|---|" + "---|" * len(figures))
    for kind in kinds:
        cells = " | ".join(f"{counted.get(kind, 0):.2f}" for counted in figures.values())
        print(f"| {kind} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
