"""KV events of a real kvroute-sim process, as a subscriber sees them on its sockets."""

from __future__ import annotations

import pytest

from tests.unit.enginesim.simproc import EventClient, SimProcess
from tests.unit.enginesim.wire_structs import decode_batch, replay_state

pytestmark = pytest.mark.e2e


def prompts(n: int, length: int = 80) -> list[list[int]]:
    return [list(range(1000 * (i + 1), 1000 * (i + 1) + length)) for i in range(n)]


def test_events_on_the_socket_describe_exactly_the_pool_through_eviction() -> None:
    with SimProcess("--instant", "--num-blocks=24") as sim, EventClient(sim) as events:
        events.connect_live()
        for prompt in prompts(12):
            sim.post("/v1/completions", {"prompt": prompt, "max_tokens": 8})
        history = events.replay(0)
        last_seq = history[-1][0]
        events.receive_until(last_seq)
        first_live = min(events.live)
        for seq, payload in history:
            if seq >= first_live:
                assert events.live[seq] == payload, "replay differs from what was sent live"
        assert [seq for seq, _ in history] == list(range(len(history)))
        payloads = [payload for _, payload in history]
        held = replay_state("vllm", payloads)
        pool = sim.call("GET", "/sim/state")[1]["cached_block_hashes"]
        assert held == set(pool)
        assert 0 < len(held) <= 24
        kinds = {type(e).__name__ for p in payloads for e in decode_batch("vllm", p).events}
        assert kinds == {"BlockStored", "BlockRemoved"}, "a 24-block pool must evict"


def test_a_subscriber_recovers_missed_batches_through_replay() -> None:
    with SimProcess("--instant") as sim, EventClient(sim) as events:
        events.connect_live()
        seen = max(events.live)
        sim.post("/sim/faults", {"pause_events": True})
        for prompt in prompts(3):
            sim.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        sim.post("/sim/faults", {"pause_events": False})
        sim.post("/v1/completions", {"prompt": list(range(26_000, 26_040)), "max_tokens": 2})
        events.receive_until(seen + 4)
        missing = [s for s in range(seen + 1, seen + 4) if s not in events.live]
        assert missing == [seen + 1, seen + 2, seen + 3], "paused batches must be a gap"
        recovered = dict(events.replay(missing[0]))
        assert set(recovered) == {*missing, seen + 4}
        events.live.update(recovered)
        ordered = [events.live[s] for s in sorted(events.live)]
        # the warm-up batches before the subscriber joined come from replay as well
        ordered = [p for _, p in events.replay(0)[: min(events.live)]] + ordered
        assert replay_state("vllm", ordered) == set(
            sim.call("GET", "/sim/state")[1]["cached_block_hashes"]
        )


def test_engine_restart_restarts_the_sequence_and_drops_replay() -> None:
    with SimProcess("--instant") as sim, EventClient(sim) as events:
        events.connect_live()
        assert max(events.live) >= 0
        sim.post("/sim/faults", {"restart": True})
        assert events.replay(0) == []
        events.live.clear()
        sim.post("/v1/completions", {"prompt": list(range(100)), "max_tokens": 1})
        events.receive_until(0)
        assert replay_state("vllm", [events.live[0]]) == set(
            sim.call("GET", "/sim/state")[1]["cached_block_hashes"]
        )


@pytest.mark.parametrize("fmt", ["vllm", "vllm-0.23", "sglang"])
def test_every_format_decodes_with_the_reference_structs(fmt: str) -> None:
    args = ["--instant", f"--event-format={fmt}", "--num-blocks=16", "--topic=kv@pod@m"]
    with SimProcess(*args) as sim, EventClient(sim) as events:
        prompt = list(range(200, 264))
        for salt in (None, "tenant-a", "tenant-b"):
            body = {"prompt": prompt, "max_tokens": 1}
            if salt:
                body["cache_salt"] = salt
            sim.post("/v1/completions", body)
        sim.post("/v1/completions", {"prompt": list(range(900, 1100)), "max_tokens": 1})
        flush = "/flush_cache" if fmt == "sglang" else "/reset_prefix_cache"  # each engine's
        assert sim.call("POST", flush)[0] == 200
        batches = [decode_batch(fmt, payload) for _, payload in events.replay(0)]
    stored = [e for b in batches for e in b.events if "Stored" in type(e).__name__]
    removed = [e for b in batches for e in b.events if "Removed" in type(e).__name__]
    cleared = [e for b in batches for e in b.events if "Cleared" in type(e).__name__]
    assert stored and removed and len(cleared) == 1
    assert all(e.block_size == 16 and e.medium == "GPU" for e in stored)
    assert all(len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
    # the same 64 tokens under three namespaces: three disjoint sets of engine hashes
    same_prompt = [frozenset(e.block_hashes) for e in stored if e.token_ids[:1] == [200]]
    assert len(same_prompt) == 3 and len(frozenset.union(*same_prompt)) == 3 * 4
    if fmt == "sglang":
        assert [e.cache_salt for e in stored[:3]] == [None, "tenant-a", "tenant-b"]
    else:
        assert [e.extra_keys for e in stored[:3]] == [
            None,
            [("tenant-a",), None, None, None],
            [("tenant-b",), None, None, None],
        ]
