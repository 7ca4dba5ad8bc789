"""The event bus: each subscriber gets the kinds it asked for, in the order subscribed,
and one that raises never keeps an event from the others."""

from __future__ import annotations

import pytest

from relay.runs.event_bus import EventBus, RunEvent


def test_a_subscriber_of_finished_runs_is_not_called_for_states_or_output() -> None:
    bus, seen = EventBus(), list[tuple[str, str]]()
    bus.subscribe(lambda event: seen.append(("all", event.kind)))
    bus.subscribe(lambda event: seen.append(("finished", event.kind)), ("finished",))
    bus.subscribe(lambda event: seen.append(("state", event.kind)), ("state", "attempt"))
    for kind in ("state", "output", "attempt", "finished"):
        bus.publish(RunEvent("run_1", kind))  # type: ignore[arg-type]
    assert seen == [
        ("all", "state"),
        ("state", "state"),
        ("all", "output"),
        ("all", "attempt"),
        ("state", "attempt"),
        ("all", "finished"),
        ("finished", "finished"),
    ]


def test_a_subscriber_ended_or_added_while_an_event_is_published_takes_effect_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus, seen = EventBus(), list[str]()

    def first(event: RunEvent) -> None:
        seen.append(f"first {event.run_id}")
        ending()
        bus.subscribe(lambda event: seen.append(f"late {event.run_id}"))
        raise RuntimeError("a broken listener")

    ending = bus.subscribe(first)
    bus.subscribe(lambda event: seen.append(f"second {event.run_id}"), ("finished",))
    bus.publish(RunEvent("run_1", "finished"))
    bus.publish(RunEvent("run_2", "finished"))
    assert seen == ["first run_1", "second run_1", "second run_2", "late run_2"]
    assert "event subscriber failed" in caplog.text
    ending()  # ended twice: nothing more
    bus.publish(RunEvent("run_3", "finished"))
    assert seen[-2:] == ["second run_3", "late run_3"]
