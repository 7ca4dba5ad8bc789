"""A receiver's ``verify_signature`` answers False to a hostile header; it never raises."""

from __future__ import annotations

from relay.client import verify_signature


def test_a_timestamp_of_digits_only_python_calls_digits_is_false_not_an_error() -> None:
    for stamp in ("\u00b2", "\u0661\u0662", "1\u00b3"):
        assert verify_signature("s", f"t={stamp},v1=00", b"{}") is False
        headers = {"webhook-id": "msg_1", "webhook-timestamp": stamp, "webhook-signature": "v1,x"}
        assert verify_signature("s", headers, b"{}") is False
