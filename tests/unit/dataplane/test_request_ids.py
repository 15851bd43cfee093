"""The ``x-request-id`` values the proxy makes up for requests that come without one."""

from __future__ import annotations

import re

from dataplane.app import RequestIds


def test_made_up_request_ids_are_32_hex_digits_a_process_prefix_and_a_counter() -> None:
    ids = RequestIds()
    made = [ids.next() for _ in range(1000)]
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in made)
    assert len(set(made)) == len(made)
    assert {i[:16] for i in made} == {made[0][:16]}  # one random half per process
    assert [int(i[16:], 16) for i in made[:3]] == [1, 2, 3]
    assert RequestIds().next()[:16] != made[0][:16]  # another process: another half
