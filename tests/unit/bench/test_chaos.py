"""The chaos benchmark's own arithmetic: a restarted child keeps its ports, the
key-for-key comparison counts what is missing and what is extra, /proc is read right."""

from __future__ import annotations

import os

from bench.chaos.fleet import pinned_argv
from bench.chaos.residency import PromptBook, compare_replica
from bench.chaos.soak import ProcessSample, ProcessTrend, group_sample
from kvroute.up import SIM_MODEL

SIM_READY = (
    "kvroute-sim ready http=http://127.0.0.1:8101 events=tcp://127.0.0.1:5601 "
    "replay=tcp://127.0.0.1:5602"
)


def test_a_restarted_simulator_keeps_the_ports_it_was_given() -> None:
    argv = ["kvroute-sim", "--port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--replay-endpoint", "tcp://127.0.0.1:0", "--model", "m"]  # fmt: skip
    pinned = pinned_argv(argv, SIM_READY)
    assert pinned == ["kvroute-sim", "--port", "8101", "--kv-events-endpoint",
                      "tcp://127.0.0.1:5601", "--replay-endpoint", "tcp://127.0.0.1:5602",
                      "--model", "m"]  # fmt: skip


def test_a_restarted_control_plane_keeps_its_admin_and_grpc_ports() -> None:
    argv = ["kvroute-controlplane", "--admin-port", "0", "--grpc-port", "0"]
    ready = "kvroute-controlplane ready admin=http://127.0.0.1:9001 grpc=127.0.0.1:9002"
    assert pinned_argv(argv, ready)[1:] == ["--admin-port", "9001", "--grpc-port", "9002"]


def _book() -> tuple[PromptBook, list[int], list[int]]:
    book = PromptBook(SIM_MODEL, "builtin")
    book.add_chat([{"role": "user", "content": " ".join(f"w{i}" for i in range(200))}])
    engine = list(book.router_of)
    router = [book.router_of[h] for h in engine]
    assert len(engine) >= 8  # a prompt of many blocks
    return book, engine, router


def test_the_residency_equal_to_the_cache_is_equal() -> None:
    book, engine, router = _book()
    check = compare_replica("r0", set(engine), set(engine), set(router), book)
    assert (check.missing, check.extra, check.equal) == (0, 0, True)


def test_a_block_the_engine_held_throughout_but_the_router_lacks_is_missing() -> None:
    book, engine, router = _book()
    check = compare_replica("r0", set(engine), set(engine), set(router[:-2]), book)
    assert (check.missing, check.extra, check.equal) == (2, 0, False)
    check.incomplete = True  # the control plane said keys may be missing: allowed
    assert check.equal


def test_a_key_the_engine_had_at_neither_read_is_extra_even_when_incomplete() -> None:
    book, engine, router = _book()
    check = compare_replica("r0", set(engine[:-3]), set(engine[:-3]), set(router), book)
    check.incomplete = True
    assert (check.missing, check.extra, check.equal) == (0, 3, False)


def test_a_block_stored_or_evicted_between_the_two_reads_is_neither() -> None:
    book, engine, router = _book()
    before, after = set(engine[:-1]), set(engine[1:])
    assert compare_replica("r0", before, after, set(router[1:]), book).equal
    assert compare_replica("r0", before, after, set(router[:-1]), book).equal


def test_generated_token_blocks_no_prompt_explains_are_compared_by_count() -> None:
    book, engine, router = _book()
    odd_engine, odd_router = {1, 2}, {11, 12}
    same = compare_replica("r0", set(engine) | odd_engine, set(engine) | odd_engine,
                           set(router) | odd_router, book)  # fmt: skip
    fewer = compare_replica("r0", set(engine) | odd_engine, set(engine) | odd_engine,
                            set(router) | {11}, book)  # fmt: skip
    assert same.equal and (fewer.missing, fewer.extra) == (1, 0)


def test_a_process_group_is_read_from_proc() -> None:
    sample = group_sample(os.getpgid(0))
    assert sample.rss_kib > 1024  # this Python process at least
    assert sample.fds >= 3


def _trend(fds: list[int]) -> ProcessTrend:
    trend = ProcessTrend("sim-0")
    trend.samples = [(10.0 * i, ProcessSample(60_000, n)) for i, n in enumerate(fds)]
    return trend


def test_fds_grow_when_their_floor_rises_not_when_a_connection_happens_to_be_open() -> None:
    """An engine's fds over a soak: connections come and go (the soak of issue 42 read
    29-36 on engines and proxies, +1 at the end by chance); a leak raises the floor."""
    assert _trend([29, 30, 30, 29, 31, 33, 29, 36, 31, 31, 29]).fd_growth == 0
    assert _trend([29, 30, 30, 30, 31, 31, 31, 32, 32, 32, 31]).fd_growth == 2
