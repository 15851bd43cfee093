"""enginesim's request-phase series against a model of the engines' own definitions
(enginesim/metrics.py): requests admitted in one step each record the whole step as
their prefill; vLLM observes a request's phases when it finishes, SGLang its queueing
when its prefill batch starts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

import enginesim.engine as engine_module
from enginesim.engine import Engine, RequestHandle
from enginesim.metrics import LoadSnapshot, buckets_1_2_5
from enginesim.request import SimRequest
from enginesim.scheduler import StepOutput
from enginesim.settings import SimSettings

IDLE = LoadSnapshot(0, 0, 0.0, 0)


def samples(engine: Engine) -> dict[str, float]:
    text = engine.metrics.render(IDLE).decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


@pytest.fixture
def engines() -> Iterator[Callable[[str], Engine]]:
    made: list[Engine] = []

    def make(event_format: str) -> Engine:
        made.append(Engine(SimSettings(event_format=event_format, model="m"), [7]))
        return made[-1]

    yield make
    for engine in made:
        engine.publisher.close()  # never started: its context only


def make_request(rid: str, tokens: int, cached: int) -> SimRequest:
    req = SimRequest(rid, list(range(tokens)), max_tokens=2)
    req.num_cached_tokens = req.hit_tokens = cached
    return req


def run_step(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, out: StepOutput, started: float, end: float
) -> None:
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: end)
    engine._deliver(out, started)


@pytest.fixture(params=["vllm", "sglang"])
def two_in_one_step(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    engines: Callable[[str], Engine],
) -> tuple[str, dict[str, float], dict[str, float]]:
    """a arrives at 0.0 and b at 0.2; one step from 1.0 to 1.5 admits both (their first
    tokens); they finish at 3.0."""
    engine = engines(request.param)
    a, b = make_request("a", 2000, 512), make_request("b", 1000, 0)
    engine._handles[a] = RequestHandle(a, False, 0.0)
    engine._handles[b] = RequestHandle(b, False, 0.2)
    run_step(engine, monkeypatch, StepOutput(admitted=[a, b]), 1.0, 1.5)
    at_first_tokens = samples(engine)
    run_step(engine, monkeypatch, StepOutput(finished=[a, b]), 2.9, 3.0)
    return request.param, at_first_tokens, samples(engine)


def test_each_request_of_a_step_records_the_whole_step_as_its_prefill(
    two_in_one_step: tuple[str, dict[str, float], dict[str, float]],
) -> None:
    event_format, at_first_tokens, finished = two_in_one_step
    if event_format == "vllm":
        # nothing until they finish; then each its own queueing, and the step twice
        assert at_first_tokens["vllm:request_prefill_time_seconds_count"] == 0
        assert at_first_tokens["vllm:request_queue_time_seconds_count"] == 0
        assert finished["vllm:request_prefill_time_seconds_count"] == 2
        assert finished["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.5 + 0.5)
        assert finished["vllm:request_queue_time_seconds_sum"] == pytest.approx(1.0 + 0.8)
        assert finished["vllm:request_prefill_kv_computed_tokens_sum"] == 1488 + 1000
        assert finished["vllm:request_prefill_kv_computed_tokens_count"] == 2
    else:
        # SGLang: queueing observed as the prefill batch takes them; no prefill series
        assert at_first_tokens["sglang:queue_time_seconds_count"] == 2
        assert at_first_tokens["sglang:queue_time_seconds_sum"] == pytest.approx(1.8)
        assert at_first_tokens["sglang:time_to_first_token_seconds_sum"] == pytest.approx(1.5 + 1.3)
        assert not any("prefill_time" in name for name in finished)


def test_the_computed_tokens_buckets_are_vllms_1_2_5_series(
    engines: Callable[[str], Engine],
) -> None:
    assert buckets_1_2_5(600) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    text = engines("vllm").metrics.render(IDLE).decode()
    assert 'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"}' in text
    assert "# TYPE vllm:request_prefill_kv_computed_tokens histogram" in text
