"""Several kvroute routers behind a round-robin balancer, each seeing only its own sends,
must still spread one fleet's work as one router does."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.sim.contenders import router_factory
from bench.sim.engine import EngineShape
from bench.sim.simulator import SimConfig, Simulation
from bench.sim.workloads import MultiTurn

SHAPE = EngineShape(num_blocks=8192, max_num_seqs=64)


def requests_per_replica(routers: int, seed: int) -> list[int]:
    """48 chats of 5 turns, every one opening with one 200-token system prompt, through
    ``routers`` kv_aware routers onto 4 replicas: the requests each replica served."""
    config = SimConfig(replicas=4, shape=SHAPE, router_instances=routers)
    chats = MultiTurn(sessions=48, rate=4.0, seed=seed, system_tokens=200, turns=5)
    factory = router_factory("kv_aware", SHAPE, seed=seed, load_period_s=0.5)
    served = Counter(r.replica for r in Simulation(config, chats, factory).run().requests)
    return [served[i] for i in range(4)]


@pytest.mark.parametrize("routers", [1, 4, 8])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_every_replica_takes_a_share_of_a_chat_app_however_many_routers(
    routers: int, seed: int
) -> None:
    """Each router judged the shared system prompt hot by its own count alone: behind
    four or eight routers each saw too few requests, so the first replicas to hold the
    prompt kept every new chat (240/0/0/0 and 0/135/105/0 among these seeds) while one
    router spread them. Every replica now serves at least half its even share."""
    served = requests_per_replica(routers, seed)
    assert sum(served) == 240
    assert min(served) >= 240 / 4 / 2, served
