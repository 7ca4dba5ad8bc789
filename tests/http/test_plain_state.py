"""The app's state (relay/http/app_state.py ``PlainState``) keeps each value twice, as
Starlette's ``State`` does and as a plain attribute: both ways must read the same."""

from __future__ import annotations

import pytest
from starlette.datastructures import State

from relay.http.app_state import PlainState


@pytest.mark.parametrize("kind", [State, PlainState], ids=["starlette", "plain"])
def test_the_apps_state_reads_sets_and_deletes_as_starlettes_does(kind: type[State]) -> None:
    state = kind()
    state.relay = "first"
    assert (state.relay, state["relay"], list(state), len(state)) == (
        "first",
        "first",
        ["relay"],
        1,
    )
    state["relay"] = "second"
    assert (state.relay, state["relay"]) == ("second", "second")
    state.relay = "third"
    assert (state.relay, state["relay"]) == ("third", "third")
    del state["relay"]
    with pytest.raises(AttributeError, match="object has no attribute 'relay'"):
        state.relay  # noqa: B018
    with pytest.raises(KeyError):
        state["relay"]
    state.metrics = 1
    del state.metrics
    assert not hasattr(state, "metrics") and len(state) == 0
    with pytest.raises((AttributeError, KeyError)):
        del state.metrics
