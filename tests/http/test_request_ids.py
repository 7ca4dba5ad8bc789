"""Request ids (relay/http/app.py ``RequestIds``): drawn from the OS's random source a pool at
a time, each one taken once, in this process and in a forked child."""

from __future__ import annotations

import os
import re
import warnings

from relay.http.app import REQUEST_IDS, RequestIds


def test_request_ids_are_req_and_16_hex_digits_and_never_repeat_across_pools() -> None:
    ids = RequestIds()
    per_pool = RequestIds.POOL_BYTES // 8
    taken = [ids.new() for _ in range(per_pool * 3 + 5)]
    assert all(re.fullmatch(r"req_[0-9a-f]{16}", each) for each in taken)
    assert len(set(taken)) == len(taken)


def test_a_forked_child_draws_request_ids_its_parent_does_not_take() -> None:
    REQUEST_IDS.new()  # the pool holds ids the parent will take next
    reading, writing = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns of fork() in a process with threads; the child only writes a pipe.
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(writing, REQUEST_IDS.new().encode())
        os._exit(0)
    os.close(writing)
    _, status = os.waitpid(child, 0)
    childs = os.read(reading, 64).decode()
    os.close(reading)
    assert status == 0 and re.fullmatch(r"req_[0-9a-f]{16}", childs)
    parents = [REQUEST_IDS.new() for _ in range(RequestIds.POOL_BYTES // 8)]
    assert childs not in parents
