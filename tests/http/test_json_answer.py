"""A JSON answer (relay/http/routes.py ``json_answer``) puts its head together itself: its
bytes and head must be what Starlette's ``Response`` with ``model_dump_json`` gives."""

from __future__ import annotations

import pytest
from starlette.responses import Response

from relay.http.routes import JsonAnswer, json_answer
from relay.runs.models import Health

ODD_TEXT = 'é "quoted" \\ \n\t\x00\x1f \u2028\u2029 😀 \ud7ff \ufffd'


@pytest.mark.parametrize("status", [200, 202, 404, 503, 204, 304, 101])
@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {"Location": "/v1/runs/run_1"},
        {"Vary": "Accept", "X-Two": "second"},
        {"Content-Type": "application/problem+json"},
        {"content-length": "3"},
    ],
)
def test_a_json_answer_has_the_bytes_and_head_starlettes_response_gives_it(
    status: int, headers: dict[str, str] | None
) -> None:
    model = Health(status="ok", checks={"store": ODD_TEXT, ODD_TEXT: "ok"})
    answer = json_answer(model, status, headers)
    expected = Response(
        model.model_dump_json(), status_code=status, headers=headers, media_type="application/json"
    )
    assert isinstance(answer, JsonAnswer)
    assert answer.body == expected.body
    assert answer.raw_headers == expected.raw_headers
    assert (answer.status_code, answer.background) == (expected.status_code, None)
    assert answer.headers.get("content-type") == expected.headers.get("content-type")
