"""``bench.e2e.misses``: each miss of a run gets the one cause a reader can act on."""

from __future__ import annotations

from bench.e2e.misses import classify, limit_hit_rate, records
from kvroute.demo import Answer, DemoWorkload

PREFIX = 2000


def answer(
    index: int, sent: float, replica: str, cached: int, ttft: float = 0.2, predicted: int = 0
) -> Answer:
    return Answer(index, sent, ttft, 2099, cached, replica, f"{predicted}/131")


def test_every_cause_is_told_apart_in_the_order_requests_were_sent() -> None:
    groups = [0, 0, 0, 0, 0, 1, 1]
    answers = [
        answer(0, 0.0, "r0", 0),  # the group's first request
        answer(1, 0.1, "r0", 0, predicted=125),  # r0 has not answered the first yet
        answer(2, 1.0, "r0", PREFIX),  # a hit
        answer(3, 2.0, "r0", 800, predicted=125),  # r0 had answered: evicted, in part
        answer(4, 3.0, "r1", 0),  # the router sent it away from r0
        answer(5, 0.5, "r1", 0),  # group 1's first
        answer(6, 1.5, "r1", PREFIX),
    ]
    misses, causes = classify(answers, groups)
    assert causes == ["first", "in_flight", "", "evicted", "elsewhere", "first", ""]
    assert (misses.first, misses.in_flight, misses.evicted, misses.elsewhere) == (2, 1, 1, 1)
    assert misses.avoidable == 3
    assert misses.lost_tokens == PREFIX + (PREFIX - 800) + PREFIX
    assert misses.over_predicted == 2  # predicted the whole prefix; the engine had less


def test_a_group_no_request_ever_hit_has_no_prefix_to_miss() -> None:
    misses, causes = classify([answer(0, 0.0, "r0", 0)], [7])
    assert causes == [""] and misses.first == 0


def test_a_router_that_does_not_say_where_leaves_its_later_misses_unknown() -> None:
    answers = [answer(0, 0.0, "?", 0), answer(1, 1.0, "?", PREFIX), answer(2, 2.0, "?", 0)]
    misses, causes = classify(answers, [3, 3, 3])
    assert causes == ["first", "", "unknown"]
    assert misses.over_predicted == 0


def test_records_follow_the_send_order_and_name_each_group() -> None:
    workload = DemoWorkload(groups=2, prompts_per_group=2)
    groups = workload.request_groups()
    assert sorted(groups) == [0, 0, 1, 1]
    for body, group in zip(workload.requests("m"), groups, strict=True):
        assert body["messages"][0]["content"].startswith(f"You are assistant number {group}.")
    answers = [answer(i, 1.0 - i / 10, "r0", PREFIX if i else 0) for i in range(4)]
    lines = records(answers, groups)
    assert [line["sent_s"] for line in lines] == sorted(line["sent_s"] for line in lines)
    assert {line["group"] for line in lines} == {0, 1}


def test_the_limit_counts_every_request_but_each_groups_first_as_a_whole_hit() -> None:
    answers = [answer(0, 0.0, "r0", 0), answer(1, 1.0, "r0", 800), answer(2, 2.0, "r0", PREFIX)]
    assert limit_hit_rate(answers, [0, 0, 0]) == 2 * PREFIX / (3 * 2099)
    assert limit_hit_rate([], []) == 0.0
