"""bench.proxy_path drives the real request path in memory and reports its CPU per request."""

from __future__ import annotations

import uvloop

from bench.proxy_path import BATCHES, measure


def test_every_request_goes_through_the_proxy_and_each_batch_is_timed() -> None:
    samples = uvloop.run(measure(requests=100, strategy="prefix_hash", profile=False, warmup=20))
    assert len(samples) == BATCHES
    assert all(0 < sample < 1_000_000 for sample in samples)  # microseconds per request
