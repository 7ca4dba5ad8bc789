"""``python -m bench`` (``make bench``): measure the relay's own cost, write bench/RESULTS.md.

``--smoke`` runs every benchmark on tiny samples (seconds, for the test suite); its
figures are not to be quoted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import admission, bounded, local, mcp_calls, promises, rounds, servers, waiting
from bench.load import LoadResult, run_wrk
from bench.report import PLAIN_FLOOR, Results, machine_line, render, targets
from relay.providers.local.invocation import bwrap_works
from testing.postgres import new_database

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
NOOP = {"job": "noop"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny samples, a few seconds")
    parser.add_argument("--out", type=Path, default=None, help="where to write the results")
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="wrk time per target and level, all rounds together",
    )
    parser.add_argument(
        "--overhead-rounds",
        type=int,
        default=None,
        help="(1) rounds, each over every level of every target; --seconds is split among them",
    )
    parser.add_argument(
        "--pin",
        choices=("yes", "no"),
        default="no",
        help="(1) servers on one CPU, wrk on the others (when there are 2 or more)",
    )
    parser.add_argument("--callers", type=int, default=None, help="waiting callers")
    parser.add_argument("--sleep-s", type=int, default=None, help="how long each waits")
    parser.add_argument("--rounds", type=int, default=None, help="echo runs per way")
    parser.add_argument(
        "--postgres",
        choices=("auto", "yes", "no"),
        default=None,
        help="(4) PostgreSQL: auto skips with the reason when no server can be had",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("overhead", "waiting", "local", "admission", "bounded"),
        help="run only these benchmarks (repeatable); default: all",
    )
    args = parser.parse_args(argv)
    args.only = set(args.only or ("overhead", "waiting", "local", "admission", "bounded"))
    smoke = args.smoke
    args.seconds = args.seconds or (2.0 if smoke else 8.0)
    args.overhead_rounds = args.overhead_rounds or (2 if smoke else 8)
    args.callers = args.callers or (20 if smoke else 1000)
    args.sleep_s = args.sleep_s or (2 if smoke else 20)
    args.rounds = args.rounds or (3 if smoke else 100)
    args.postgres = args.postgres or ("no" if smoke else "auto")
    args.levels = (1, 10) if smoke else (1, 10, 50)
    args.day_runs = (1_000,) if smoke else (10_000, 100_000)
    args.admissions = 10 if smoke else 200
    args.big_runs = 10 if smoke else 200  # runs with 1 MiB of stdout and of stderr
    args.listings = 3 if smoke else 20
    args.kept_runs = 500 if smoke else 10_000
    args.out = args.out or (
        Path(tempfile.gettempdir()) / "relay-bench-smoke.md" if smoke else RESULTS
    )
    return args


@contextlib.contextmanager
def _postgres(mode: str, results: Results) -> Iterator[str | None]:
    """A throwaway PostgreSQL (testing/postgres.py), or None with the reason recorded."""
    if mode == "no":
        results.postgres_note = "not run (--postgres no)."
        yield None
        return
    import pytest

    from testing.postgres import start_postgres

    try:
        with start_postgres() as url:
            yield url
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        if mode == "yes":
            raise SystemExit(f"PostgreSQL wanted but unavailable: {exc}") from None
        results.postgres_note = f"not run: {exc}"
        yield None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _waiting(root: Path, args: argparse.Namespace, results: Results) -> None:
    with servers.relay(root / "waiting") as (relay, token):
        assert relay.process is not None
        results.waiting["relay"] = waiting.run_relay(
            relay.url,
            token,
            pid=relay.process.pid,
            database=relay.root / "relay.db",
            callers=args.callers,
            sleep_s=args.sleep_s,
        )
    with servers.baseline() as (process, base_url):
        results.waiting["baseline"] = waiting.run_baseline(
            base_url, pid=process.pid, callers=args.callers, sleep_s=args.sleep_s
        )


def _overhead_and_local(root: Path, args: argparse.Namespace, results: Results) -> None:
    """(1) and (4) against the baseline, then (3) on the same SQLite relay."""
    overhead = "overhead" in args.only
    with contextlib.ExitStack() as stack:
        pg_url = stack.enter_context(_postgres(args.postgres if overhead else "no", results))
        base, base_url = stack.enter_context(servers.baseline())
        relay, token = stack.enter_context(servers.relay(root / "sqlite"))
        assert relay.process is not None
        floor, floor_url = stack.enter_context(servers.floor(root / "floor", token))
        targets_by_name = {
            "baseline": (base_url, None, base.pid),
            "relay (SQLite)": (relay.url, token, relay.process.pid),
            # Next to each other: each round measures them back to back (bench/rounds.py).
            "floor (SQLite)": (floor_url, token, floor.pid),
        }
        if overhead:  # the floor as it was served before issue 42's third pass, beside it
            plain, plain_url = stack.enter_context(
                servers.floor(root / "floor-plain", token, plain=True)
            )
            targets_by_name[f"{PLAIN_FLOOR} (SQLite)"] = (plain_url, token, plain.pid)
        if pg_url is not None:
            pg_relay, pg_token = stack.enter_context(
                servers.relay(root / "postgres", database_url=pg_url)
            )
            assert pg_relay.process is not None
            targets_by_name["relay (PostgreSQL)"] = (pg_relay.url, pg_token, pg_relay.process.pid)
            # The floor on the same server, in a database of its own (the relay's counts
            # its own runs).
            floor_url = asyncio.run(new_database(pg_url))
            pg_floor, pg_floor_url = stack.enter_context(
                servers.floor(root / "floor-pg", pg_token, database_url=floor_url)
            )
            targets_by_name["floor (PostgreSQL)"] = (pg_floor_url, pg_token, pg_floor.pid)
        if overhead:
            _overhead(targets_by_name, args, results)
        if "local" not in args.only:
            return
        if not bwrap_works():
            results.local_note = "not run: bubblewrap is missing or cannot work here"
            return
        _say(f"(3) local provider: echo, {args.rounds} rounds of each way")
        results.local = local.run(relay.url, token, rounds=args.rounds)


def _overhead(
    targets_by_name: dict[str, tuple[str, str | None, int]],
    args: argparse.Namespace,
    results: Results,
) -> None:
    """(1) and (4): ``args.overhead_rounds`` short rounds, each over every level of every
    target, the levels' order rotated and the targets' flipped each round
    (bench/rounds.py); with ``args.pin`` the servers on one CPU and wrk on the others."""
    seconds = rounds.round_seconds(args.seconds, args.overhead_rounds)
    pids = [pid for _url, _token, pid in targets_by_name.values()]
    with rounds.pinned(pids, enabled=args.pin == "yes") as wrk_cpus:
        results.pinned = wrk_cpus is not None
        _say("(1) overhead per run: warming up")
        for url, tok, _pid in targets_by_name.values():
            run_wrk(url + "/v1/runs", NOOP, token=tok, concurrency=10, seconds=1, wrk_cpus=wrk_cpus)

        def measure(name: str, level: int) -> LoadResult:
            url, tok, pid = targets_by_name[name]
            return run_wrk(
                url + "/v1/runs",
                NOOP,
                token=tok,
                concurrency=level,
                seconds=seconds,
                server_pid=pid,
                wrk_cpus=wrk_cpus,
            )

        measured = rounds.measure_rounds(
            list(targets_by_name), args.levels, args.overhead_rounds, measure, _say
        )
    for name, by_level in measured.items():
        results.overhead[name] = [rounds.combine(by_level[level]) for level in args.levels]
        results.overhead_rounds[name] = by_level


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    command = "python -m bench" + (" " + " ".join(argv if argv is not None else sys.argv[1:]))
    results = Results(command=command.strip(), smoke=args.smoke)
    servers.raise_open_files()
    results.machine = machine_line()
    results.load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
        root = Path(folder)
        if args.only & {"overhead", "local"}:
            _overhead_and_local(root, args, results)
        if "waiting" in args.only:
            _say(f"(2) {args.callers} waiting runs of {args.sleep_s} s")
            _waiting(root, args, results)
    if "admission" in args.only:
        _say(f"admission with daily limits at {args.day_runs} runs of the day")
        results.admission = admission.run(args.day_runs, args.admissions)
    if "bounded" in args.only:
        _say(f"listing limit=200 over {args.big_runs} runs with 1 MiB outputs")
        with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
            results.listing = bounded.listing(
                Path(folder), runs=args.big_runs, requests=args.listings
            )
        _say(f"SQLite file size: {args.kept_runs} runs, then pruned")
        results.file_size = bounded.file_size(runs=args.kept_runs, output_bytes=4096)
    results.load_after = os.getloadavg()
    results.seconds = time.monotonic() - started
    text = render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    kept = args.out.read_text() if args.out.exists() else ""
    # The sections other commands write (bench/mcp_calls.py, bench/promises.py) stay.
    markers = [marker for marker in (mcp_calls.SECTION, promises.SECTION) if marker in kept]
    if markers:
        first = min(markers, key=kept.index)
        text = text.rstrip("\n") + "\n\n" + first + kept.split(first, 1)[1]
    args.out.write_text(text)
    print(text)
    for name, measured, ok in targets(results):
        print(f"{'met   ' if ok else 'MISSED'} {name}: {measured}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
