"""The proxy's tokenizer probe against real ``kvroute-sim`` engines: one tokenizes with the
built-in tokenizer, one with a tiny trained BPE; the probe flags exactly the one that
differs from the proxy's tokenizer for the model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.micro.model_files import write_tiny_model
from dataplane.fleet.state import FleetState
from dataplane.tokenizer_probe import TokenizerProbe
from kvroute.servers import free_port
from tests.unit.dataplane.state_messages import config, delta, model_entry, replica, snapshot
from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e
MODEL = "probe-model"
WORKLOADS = [{"name": "default", "strategy": "least_load"}]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-bpe"))


@pytest.fixture(scope="module")
def engines(bpe_dir: Path) -> Iterator[tuple[SimProcess, SimProcess]]:
    common = ("--instant", f"--model={MODEL}")
    with (
        SimProcess(*common, "--tokenizer=builtin") as builtin,
        SimProcess(*common, f"--tokenizer={bpe_dir}") as bpe,
    ):
        yield builtin, bpe


def fleet(engines: tuple[SimProcess, SimProcess], tokenizer: str) -> FleetState:
    replicas = []
    for ordinal, (name, sim) in enumerate(zip(("builtin", "bpe"), engines, strict=True)):
        info = replica(ordinal, model=MODEL, replica_id=name)
        info.base_url = sim.url
        replicas.append(info)
    routing = config(WORKLOADS, models=[model_entry(MODEL, tokenizer=tokenizer)])
    state = FleetState()
    for update in snapshot(1, 1, replicas, routing=routing):
        state.apply(update)
    return state


async def test_the_engine_behind_another_tokenizer_is_flagged(
    engines: tuple[SimProcess, SimProcess],
) -> None:
    probe = TokenizerProbe(fleet(engines, "builtin"), "builtin")
    try:
        await probe.probe_pending()
    finally:
        await probe.aclose()
    verdicts = {key: result.verdict for key, result in probe.results.items()}
    assert verdicts == {("builtin", MODEL): "match", ("bpe", MODEL): "mismatch"}
    detail = probe.mismatches()[MODEL]
    assert "replica bpe" in detail and "'builtin'" in detail and "replica builtin" not in detail
    assert [(h.model, h.tokenizer_mismatch) for h in probe.model_health()] == [(MODEL, True)]


async def test_with_the_engines_own_tokenizer_the_other_one_is_flagged(
    engines: tuple[SimProcess, SimProcess], bpe_dir: Path
) -> None:
    probe = TokenizerProbe(fleet(engines, str(bpe_dir)), "builtin")
    try:
        await probe.probe_pending()
    finally:
        await probe.aclose()
    verdicts = {key[0]: result.verdict for key, result in probe.results.items()}
    assert verdicts == {"builtin": "mismatch", "bpe": "match"}
    assert list(probe.mismatches()) == [MODEL]


async def test_a_new_replica_is_probed_and_an_unreachable_one_is_not_flagged(
    engines: tuple[SimProcess, SimProcess],
) -> None:
    state = fleet(engines, "builtin")
    probe = TokenizerProbe(state, "builtin", retry_s=60)
    await probe.start()
    try:
        async with asyncio.timeout(20):
            await probe.wait_until(lambda p: len(p.results) == 2)
        gone = replica(2, model=MODEL, replica_id="gone")
        gone.base_url = f"http://127.0.0.1:{free_port()}"
        state.apply(delta(1, 2, replicas_upserted=[gone], replicas_removed=[1]))
        async with asyncio.timeout(20):
            await probe.wait_until(lambda p: ("gone", MODEL) in p.results)
    finally:
        await probe.aclose()
    assert probe.results[("gone", MODEL)].verdict == "unknown"
    assert ("bpe", MODEL) not in probe.results  # it left the fleet
    assert probe.mismatches() == {}
    assert [(h.model, h.tokenizer_mismatch) for h in probe.model_health()] == [(MODEL, False)]
