"""bench.proxy_path drives the real request path in memory and reports its CPU per request."""

from __future__ import annotations

import uvloop

from bench.proxy_path import BATCHES, SPLIT, _service, measure, measure_split


def test_every_request_goes_through_the_proxy_and_each_batch_is_timed() -> None:
    samples = uvloop.run(measure(requests=100, strategy="prefix_hash", profile=False, warmup=20))
    assert len(samples) == BATCHES
    assert all(0 < sample < 1_000_000 for sample in samples)  # microseconds per request


def test_the_split_times_every_request_in_order_of_its_path() -> None:
    parts = uvloop.run(measure_split(requests=50, strategy="round_robin", warmup=10))
    assert set(parts) == set(SPLIT) == {"in", "out", "after"}
    for values in parts.values():
        assert len(values) == 50
        assert all(0 <= value < 1_000_000 for value in values)  # microseconds
    assert all(value > 0 for value in parts["in"] + parts["out"])


def test_kv_aware_runs_without_debug_headers_as_bench_proxy_runs_it() -> None:
    assert _service("kv_aware").settings.debug_headers
    assert not _service("kv_aware", debug_headers=False).settings.debug_headers
    samples = uvloop.run(
        measure(requests=50, strategy="kv_aware", profile=False, warmup=10, debug_headers=False)
    )
    assert len(samples) == BATCHES
