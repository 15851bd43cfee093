"""What SGLang 0.5.23 makes of a client's rid, and which rids it keeps taken (facts in
``enginesim/sglang_rids.py``)."""

from __future__ import annotations

import msgspec
import pytest

from enginesim import protocol as p
from enginesim import sglang_api as sg
from enginesim import sglang_rids as sr
from enginesim.engine import RequestHandle
from enginesim.request import SimRequest


def handle() -> RequestHandle:
    return RequestHandle(SimRequest(sg.request_id(), [1, 2, 3], 1), False, 0.0)


@pytest.mark.parametrize(
    ("given", "prompts", "n", "batch", "held", "names"),
    [
        (None, 2, 3, True, [], None),
        ("r", 1, 1, False, ["r"], ["r"]),
        ("r", 1, 0, False, ["r"], ["r"]),  # one prompt, n < 1: one request, named
        ("r", 2, 1, True, ["r_0", "r_1"], ["r_0", "r_1"]),
        (["a", "b"], 2, 1, True, ["a", "b"], ["a", "b"]),
        ("r", 1, 2, False, ["r_0", "r_1"], None),  # n > 1: per sample, then uuids
        ("r", 2, 2, True, ["r_0", "r_1", "r_2", "r_3"], None),
        (["a"], 1, 3, False, ["a"], None),  # a list names prompts, not samples
        ("r", 2, 0, True, [], None),  # expands to nothing: fails later, as SGLang does
    ],
)
def test_a_rid_names_each_engine_request_as_sglang_normalizes_it(
    given: sr.GivenRid, prompts: int, n: int, batch: bool, held: list[str], names: list[str]
) -> None:
    assert sr.plan(given, prompts, n, batch=batch) == sr.Rids(held, names)


@pytest.mark.parametrize(
    ("given", "prompts", "n", "batch", "status", "message"),
    [
        (["a"], 1, 1, False, 500, "Internal server error: unhashable type: 'list'"),
        (["a", "a"], 1, 1, False, 400, "Duplicate request IDs detected within the request: ['a']"),
        (["a"], 2, 1, True, 400, "The specified rids length mismatch with the batch_size for "
         "batch processing."),
        (["a", "b"], 1, 2, False, 400, "The specified rids length mismatch with the batch_size "
         "for batch processing."),
        (["a", "b", "a"], 3, 1, True, 400, "Duplicate request IDs detected within the request: "
         "['a']"),
        (["a", "b"], 2, 0, True, 500, "Internal server error: list index out of range"),
    ],
)  # fmt: skip
def test_a_rid_sglang_cannot_use_fails_as_sglang_fails_it(
    given: sr.GivenRid, prompts: int, n: int, batch: bool, status: int, message: str
) -> None:
    with pytest.raises(p.ApiError) as caught:
        sr.plan(given, prompts, n, batch=batch)
    body = sg.error_body(caught.value)
    assert (caught.value.status, body["message"]) == (status, message)
    assert body["type"] == ("BadRequestError" if status == 400 else "InternalServerError")


def test_the_body_rid_is_a_string_or_a_list_of_strings() -> None:
    assert sr.body_rid(p.ABSENT) is None
    assert sr.body_rid(msgspec.Raw(b"null")) is None
    assert sr.body_rid(msgspec.Raw(b'"r"')) == "r"
    assert sr.body_rid(msgspec.Raw(b'["a","b"]')) == ["a", "b"]
    with pytest.raises(p.BadRequest) as caught:
        sr.body_rid(msgspec.Raw(b"{}"))
    assert sg.error_body(caught.value)["message"] == (
        "Invalid request: Expected `str | array | null`, got `object` - at `$.rid`"
    )
    assert sg.error_body(caught.value)["type"] == "Bad Request"


def test_a_rid_is_taken_until_its_engine_request_is_done() -> None:
    rids = sr.RidsInFlight()
    rids.reserve(["a", "b"])
    with pytest.raises(p.BadRequest, match="Duplicate request ID detected: b"):
        rids.reserve(["c", "b"])
    rids.reserve(["c"])  # the refused request took nothing
    first, second = handle(), handle()
    rids.hold(["a", "b"], [first, second])
    rids.release(["a"])  # held by an engine request: not the caller's to give back
    with pytest.raises(p.BadRequest, match="Duplicate request ID detected: a"):
        rids.reserve(["a"])
    first.req.finished = True
    second.error = "engine restarted"
    rids.reserve(["a", "b"])
    rids.release(["a", "b", "c"])  # failed before reaching the engine
    rids.reserve(["a", "b", "c"])


def test_finished_rids_are_dropped_as_the_map_grows() -> None:
    rids = sr.RidsInFlight()
    live = handle()
    rids.reserve(["live"])
    rids.hold(["live"], [live])
    for i in range(1_000):
        done = handle()
        done.req.finished = True
        rids.reserve([f"r{i}"])
        rids.hold([f"r{i}"], [done])
    assert len(rids._holders) <= 2 * 64
    with pytest.raises(p.BadRequest, match="Duplicate request ID detected: live"):
        rids.reserve(["live"])
