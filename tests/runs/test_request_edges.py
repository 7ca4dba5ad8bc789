"""The request limits added against hostile shapes, at their edges: the last value that is
accepted and the first that is refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from relay.http.routes import MAX_JSON_DEPTH, json_depth
from relay.runs.models import MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_PATH_PARTS, RunRequest


def _files(path: str) -> RunRequest:
    return RunRequest.model_validate({"command": ["true"], "files": {path: "x"}})


def test_a_name_of_max_bytes_is_accepted_and_one_more_refused() -> None:
    assert _files("n" * MAX_NAME_BYTES).files
    with pytest.raises(ValidationError, match="each name"):
        _files("n" * (MAX_NAME_BYTES + 1))


def test_a_path_of_max_bytes_is_accepted_and_one_more_refused() -> None:
    names = ["d" * 99] * 9  # 9 x 100 bytes with their slashes
    exact = "/".join([*names, "f" * (MAX_PATH_BYTES - 900)])
    assert len(exact.encode()) == MAX_PATH_BYTES
    assert _files(exact).files
    with pytest.raises(ValidationError, match=f"{MAX_PATH_BYTES} bytes"):
        _files(exact + "f")


def test_a_path_of_max_names_is_accepted_and_one_more_refused() -> None:
    assert _files("/".join(["d"] * (MAX_PATH_PARTS - 1) + ["f"])).files
    with pytest.raises(ValidationError, match="names deep"):
        _files("/".join(["d"] * MAX_PATH_PARTS + ["f"]))


def test_json_depth_counts_to_the_limit() -> None:
    nested: object = 1
    for _ in range(MAX_JSON_DEPTH):
        nested = [nested]
    assert json_depth(nested) == MAX_JSON_DEPTH  # accepted by the handler
    assert json_depth([nested]) == MAX_JSON_DEPTH + 1  # refused: 400 invalid_request


def test_parsed_echoes_kept_for_answers_are_bounded_in_number_and_size() -> None:
    """The answers' parse of a run's request echo is remembered by its text: at most
    MAX_ECHOES of them, the oldest forgotten, and never one over MAX_ECHO_CHARS."""
    from relay.runs import view
    from testing.rows import run_row

    view._ECHOES.clear()
    for number in range(view.MAX_ECHOES + 10):
        echo = RunRequest(job="noop", params={"n": number}).echo()
        answer = view.run_model(run_row(f"run_{number:x}", request=json.dumps(echo)))
        assert answer.request is not None and answer.request.params == {"n": number}
    assert len(view._ECHOES) == view.MAX_ECHOES
    first = json.dumps(RunRequest(job="noop", params={"n": 0}).echo())
    last = json.dumps(RunRequest(job="noop", params={"n": view.MAX_ECHOES + 9}).echo())
    assert first not in view._ECHOES and last in view._ECHOES  # the oldest are forgotten
    big = json.dumps(RunRequest(job="noop", params={"x": "y" * view.MAX_ECHO_CHARS}).echo())
    assert view.run_model(run_row("run_b16", request=big)).request is not None
    assert big not in view._ECHOES
