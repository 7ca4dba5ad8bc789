"""The request limits added against hostile shapes, at their edges: the last value that is
accepted and the first that is refused."""

from __future__ import annotations

import json

import hypothesis
import pytest
from hypothesis import strategies as st
from pydantic import ValidationError

from relay.http.routes import MAX_JSON_DEPTH, json_depth
from relay.runs.models import MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_PATH_PARTS, RunRequest, Size


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


@pytest.mark.parametrize(
    "body",
    [
        {"job": "noop"},
        {"command": ["echo", 'a "quoted"\tline\n', "é ü 中 \U0001f600", "\x7f\x1f"], "wait": False},
        {
            "job": "report-2",
            "params": {"n": 1, "x": 1e16, "y": 1e-05, "z": [True, None, 2.5], "é": {"k": "\u2028"}},
            "provider": "local",
            "image": "python:3.12 é",
            "size": "large",
            "env": {"B": "secret", "A": "also secret"},
            "stdin": "héllo",
            "files": {"b/é.txt": "x", "a.txt": "y"},
            "workdir": "work/dir",
            "timeout_s": 12.5,
            "egress": ["pypi.org", "example.com"],
            "callback_url": "https://hooks.example.com/x",
            "artifacts": ["out/*.png", "report.txt"],
        },
        {"job": "noop", "timeout_s": 86400, "egress": [], "params": {"n": -0.0, "t": (1, "é")}},
    ],
)
def test_a_requests_stored_echo_is_the_text_json_dumps_writes_of_it(
    body: dict[str, object],
) -> None:
    """The run keeps its request's echo as ``json.dumps(echo, separators=(",", ":"))`` writes
    it; the text put together from its parts is that text, character for character."""
    parsed = RunRequest.model_validate_json(json.dumps(body))  # as the API takes it
    assert parsed.echo_text() == json.dumps(parsed.echo(), separators=(",", ":"))
    size = body.get("size")
    made = RunRequest.model_validate(body | ({"size": Size(size)} if size else {}))  # a caller's
    made.params["inf"] = float("inf")  # the dump's own kinds: Infinity, a tuple as a list
    assert made.echo_text() == json.dumps(made.echo(), separators=(",", ":"))


def test_the_echo_text_knows_every_field_of_a_request() -> None:
    """A field added to RunRequest must be added to ``echo_text`` too (or left out of the
    echo as a secret): this list is the reminder."""
    assert list(RunRequest.model_fields) == [
        "job", "params", "command", "provider", "image", "size", "env", "stdin", "files",
        "workdir", "timeout_s", "egress", "wait", "callback_url", "artifacts",
    ]  # fmt: skip


# No lone surrogates: a request's JSON cannot carry one (the body's parser refuses a lone
# ``\\ud800`` escape: a 422), and pydantic cannot dump one in a dict's key either.
_TEXT = st.text(
    st.characters(exclude_categories=("Cs",)) | st.sampled_from('"\\\u2028\u2029\x00\x1f\x7f')
)
_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    params=st.dictionaries(_TEXT, _VALUE, max_size=4),
    command=st.lists(_TEXT.filter(lambda arg: "\x00" not in arg), min_size=1, max_size=3),
    image=st.none() | _TEXT.filter(lambda image: "\x00" not in image).map(lambda s: s[:255]),
    timeout_s=st.none() | st.floats(min_value=1e-300, max_value=86_400) | st.integers(1, 86_400),
)
def test_a_requests_echo_text_is_json_dumps_for_any_params_strings_and_numbers(
    params: dict[str, object], command: list[str], image: str | None, timeout_s: float | None
) -> None:
    """Whatever a caller sends (quotes, backslashes, control and line-separator characters,
    non-BMP text, huge integers, NaN and infinities in params), the echo put together from
    its parts is the text json.dumps writes of it, and reads back as the same echo."""
    body = {"command": command, "params": params, "image": image, "timeout_s": timeout_s}
    try:
        request = RunRequest.model_validate(body)
    except ValidationError:
        return  # refused as any request is; nothing stored
    text = request.echo_text()
    assert text == json.dumps(request.echo(), separators=(",", ":"))
    assert json.loads(text)["command"] == request.command


@pytest.mark.parametrize(
    "body",
    [
        {"job": "noop"},
        {"job": "noop", "wait": False},
        {"job": "noop", "provider": "memory", "stdin": ""},
        {"job": "other", "env": {}, "files": {}, "params": {}, "artifacts": []},
        {"command": ["true"]},
    ],
)
def test_a_plain_requests_echo_made_once_is_the_text_of_each_request_like_it(
    body: dict[str, object],
) -> None:
    """A request naming a job (a provider, ``wait``) and nothing else the echo shows takes
    the text made for the first like it: the same text ``json.dumps`` writes, every time;
    a request changed in place since is not plain, and gets its own."""
    for _ in range(2):  # the first makes it, the second takes it made
        request = RunRequest.model_validate_json(json.dumps(body))
        assert request.echo_text() == json.dumps(request.echo(), separators=(",", ":"))
    for field, value in (("env", "x"), ("files", "x"), ("params", 1)):
        changed = RunRequest.model_validate_json(json.dumps(body))
        getattr(changed, field)["SECRET"] = value  # one field changed in place, after it was made
        assert changed.echo_text() == json.dumps(changed.echo(), separators=(",", ":"))
        assert changed.echo_text() != request.echo_text()


_A_VALUE_FOR_EACH_FIELD: dict[str, object] = {
    "job": "other",
    "params": {"n": 1},
    "command": ["true"],
    "provider": "memory",
    "image": "python:3.12",
    "size": "small",
    "env": {"A": "b"},
    "stdin": "in",
    "files": {"a.txt": "x"},
    "workdir": "src",
    "timeout_s": 5,
    "egress": ["example.com"],
    "wait": False,
    "callback_url": "https://example.com/hook",
    "artifacts": ["out/*"],
}


@pytest.mark.parametrize("field", sorted(RunRequest.model_fields))
def test_no_request_field_is_missed_by_the_reused_plain_echo(field: str) -> None:
    """Every field a request can set either shows in its echo as ``json.dumps`` writes it or
    leaves the echo alone: a field added to ``RunRequest`` that the plain check forgets would
    hand a request the text made for another (a new field needs a value here first)."""
    assert field in _A_VALUE_FOR_EACH_FIELD, f"give {field!r} a value in this test"
    plain = RunRequest.model_validate_json(json.dumps({"job": "noop"}))
    plain.echo_text()  # the plain text made and kept
    body: dict[str, object] = {"job": "noop", field: _A_VALUE_FOR_EACH_FIELD[field]}
    if field == "command":
        body.pop("job")
    request = RunRequest.model_validate_json(json.dumps(body))
    assert request.echo_text() == json.dumps(request.echo(), separators=(",", ":"))
