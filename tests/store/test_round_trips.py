"""A run's round trips to PostgreSQL (issue 42, item 2), counted as ``python -m bench.round_trips``
counts them: the socket sends of the relay's app driven in process, one run at a time."""

from __future__ import annotations

import asyncio

import pytest

from bench.round_trips import count

pytestmark = pytest.mark.postgres


def test_a_runs_final_write_on_postgresql_is_one_statement_without_begin_and_commit(
    postgres_url: str,
) -> None:
    # Its own loop: the sends are counted on asyncio's selector loop (bench/round_trips.py).
    figures = asyncio.run(count(postgres_url, 20))["one at a time"]
    # Two checkouts (each with its pre-ping), the admission's BEGIN, lock, count, INSERT and
    # COMMIT, and the final UPDATE on its own: 12 sends. It was 14, with the final
    # UPDATE in a BEGIN and COMMIT of its own.
    assert figures["UPDATE"] == 1 and figures["INSERT"] == 1
    assert figures["sends"] <= 12, figures
