"""FleetState: the routing state a proxy applies from its Watch stream and routes on."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.errors import SnapshotNeeded
from dataplane.fleet import state as fleet_state
from dataplane.fleet.state import FleetState
from dataplane.fleet.views import ViewCache
from kvcore.keys import block_keys
from kvcore.pb import events_pb2
from kvcore.policies import RouteContext, create_policy
from kvcore.workload import KvAwareWorkload, RequestInfo, parse_workload
from tests.unit.dataplane.state_messages import (
    DRAINING,
    MODEL,
    UNHEALTHY,
    config,
    delta,
    load,
    model_entry,
    replica,
    residency_change,
    snapshot,
)

KEYS = block_keys(list(range(64)), model=MODEL)  # 4 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(clock: Clock | None = None, max_age_s: float = 30.0) -> FleetState:
    return FleetState(clock=clock or Clock(), max_age_s=max_age_s)


def apply_all(state: FleetState, updates: list) -> None:
    for update in updates:
        state.apply(update)


def ids(state: FleetState, model: str = MODEL) -> list[str]:
    return [r.replica_id for r in state.views.view(model).replicas()]


def route(state: FleetState, workload: KvAwareWorkload, keys: list[int], now: float = 0.0):
    ctx = RouteContext(workload=workload, model=MODEL, block_keys=keys, now=now)
    decision = create_policy(workload, rng=random.Random(0)).select(ctx, state.views.view(MODEL))
    state.replicas.apply_speculative(decision)
    return decision


# -- snapshots ---------------------------------------------------------------------------


def test_a_chunked_snapshot_is_invisible_until_its_last_chunk() -> None:
    state = fleet()
    updates = snapshot(7, 40, [replica(0), replica(1)], {0: KEYS, 1: KEYS[:2]}, chunks=3)
    for update in updates[:-1]:
        state.apply(update)
        assert ids(state) == []
        assert state.position() == (0, 0)
    state.apply(updates[-1])
    assert ids(state) == ["r0", "r1"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4, 1: 2}
    assert state.position() == (7, 40)


def test_a_new_snapshot_replaces_everything() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 5, [replica(0), replica(1)], {0: KEYS, 1: KEYS}))
    apply_all(state, snapshot(2, 1, [replica(0, replica_id="fresh")], {0: KEYS[:1]}))
    assert ids(state) == ["fresh"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 1}
    assert state.replicas.endpoint(1) is None
    assert state.position() == (2, 1)


def test_an_interrupted_snapshot_keeps_the_old_state_and_asks_again() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 5, [replica(0)], {0: KEYS}))
    first, _, third = snapshot(1, 9, [replica(1)], {1: KEYS}, chunks=3)
    state.apply(first)
    with pytest.raises(SnapshotNeeded, match="chunk 2"):
        state.apply(third)  # chunk 1 was lost
    assert ids(state) == ["r0"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4}
    assert state.position() == (0, 0)


# -- deltas ------------------------------------------------------------------------------


def test_deltas_upsert_remove_and_change_residency() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 10, [replica(0), replica(1)], {0: KEYS, 1: KEYS}))
    state.apply(delta(1, 11, replicas_upserted=[replica(2)], replicas_removed=[1]))
    assert ids(state) == ["r0", "r2"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4}
    state.apply(
        delta(
            1,
            12,
            residency=[
                residency_change(2, added=KEYS[:3]),
                residency_change(0, cleared=True, added=KEYS[:2], removed=KEYS[1:2]),
            ],
        )
    )
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 1, 2: 3}
    assert state.position() == (1, 12)


def test_a_version_gap_or_new_epoch_asks_for_a_snapshot_and_keeps_serving() -> None:
    state = fleet()
    apply_all(state, snapshot(3, 10, [replica(0)], {0: KEYS}))
    with pytest.raises(SnapshotNeeded, match="version 12 after version 10"):
        state.apply(delta(3, 12, replicas_removed=[0]))
    assert state.position() == (0, 0)
    assert ids(state) == ["r0"]  # still routing on what it had
    with pytest.raises(SnapshotNeeded, match="before a complete snapshot"):
        state.apply(delta(3, 11))  # nothing more applies until the snapshot
    apply_all(state, snapshot(4, 1, [replica(0)], {0: KEYS}))
    with pytest.raises(SnapshotNeeded, match="epoch changed from 4 to 5"):
        state.apply(delta(5, 2))


def test_load_updates_reach_the_view() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0), replica(1)]))
    state.apply(delta(1, 2, loads=[{"ordinal": 1, "load": load(32, 16, ts=50.0, kv_usage=0.2)}]))
    r0, r1 = state.views.view(MODEL).replicas()
    assert (r1.running, r1.waiting, r1.load) == (32, 16, 0.75)  # 48 of 64 sequences
    assert r0.load == 0.0
    # an upsert without a load (status change) keeps the last load
    state.apply(delta(1, 3, replicas_upserted=[replica(1, capacity=96)]))
    assert state.views.view(MODEL).replicas()[1].load == 0.5


def test_malformed_entries_are_skipped_and_counted() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0), replica(5000)], {0: KEYS, 7: KEYS}))
    state.apply(delta(1, 2, residency=[residency_change(9, added=KEYS)], loads=[{"ordinal": 8}]))
    assert ids(state) == ["r0"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4}
    assert state.ignored == 5  # replica 5000, two ReplicaBlocks of 7, residency of 9, load of 8


def test_large_updates_are_applied_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_state, "STEP_KEYS", 100)
    state = fleet()
    keys = list(range(1, 1001))
    steps = sum(1 for _ in state.apply_steps(snapshot(1, 1, [replica(0)], {0: keys})[0]))
    assert steps >= 10
    assert state.replicas.residency_keys() == 1000
    clear = delta(1, 2, residency=[residency_change(0, cleared=True)])
    assert sum(1 for _ in state.apply_steps(clear)) >= 10
    assert state.replicas.residency_keys() == 0


# -- what the views offer ----------------------------------------------------------------


def test_only_healthy_non_draining_replicas_of_the_model_are_offered() -> None:
    state = fleet()
    replicas = [
        replica(0),
        replica(1, status=DRAINING),
        replica(2, status=UNHEALTHY),
        replica(3, status=0),  # unspecified
        replica(4, model="other"),
        replica(5, model="org/m-7b", served=["m"]),
    ]
    apply_all(state, snapshot(1, 1, replicas))
    assert ids(state) == ["r0", "r5"]
    assert ids(state, "other") == ["r4"]
    assert ids(state, "nobody-serves-this") == []
    assert state.catalogue.served_models() == ["m", "org/m-7b", "other"]
    state.apply(delta(1, 2, replicas_upserted=[replica(0, status=DRAINING)]))
    assert ids(state) == ["r5"]
    assert [e.replica_id for e in state.replicas.endpoints()] == ["r4", "r5"]


def test_model_registry_names_resolve_to_the_canonical_model() -> None:
    state = fleet()
    entry = model_entry("llama", model="meta/llama-8b", served_names=["gpt-4o"])
    routing = config([{"name": "default", "strategy": "least_load"}], models=[entry])
    apply_all(state, snapshot(1, 1, [replica(0, model="meta/llama-8b")], routing=routing))
    for name in ("llama", "gpt-4o", "meta/llama-8b"):
        assert ids(state, name) == ["r0"]
        assert state.catalogue.canonical_model(name) == "meta/llama-8b"
        assert state.catalogue.model_entry(name) == entry
    assert state.catalogue.canonical_model("unknown") is None
    assert state.catalogue.models() == {"llama": entry}


def sglang(info: Any) -> Any:
    info.engine_kind = events_pb2.ENGINE_KIND_SGLANG
    return info


def test_a_request_naming_no_model_or_any_name_goes_where_the_engines_would_take_it() -> None:
    """No model: the fleet's one base model (its replicas' own names, not aliases).
    Any name: the same, only where every replica is SGLang, which checks no name."""
    fleets = {
        "one vLLM model": [replica(0, served=["alias"]), replica(1)],
        "one SGLang model": [sglang(replica(0)), sglang(replica(1))],
        "SGLang beside vLLM": [sglang(replica(0)), replica(1)],
        "two SGLang models": [sglang(replica(0)), sglang(replica(1, model="other"))],
    }
    seen = {}
    for name, replicas in fleets.items():
        state = fleet()
        apply_all(state, snapshot(1, 1, replicas))
        seen[name] = (state.catalogue.base_models(), state.catalogue.any_name_model())
    assert seen == {
        "one vLLM model": ([MODEL], None),
        "one SGLang model": ([MODEL], MODEL),
        "SGLang beside vLLM": ([MODEL], None),
        "two SGLang models": ([MODEL, "other"], None),
    }


def test_the_router_block_size_comes_from_the_replicas_announcements() -> None:
    state = fleet()
    replicas = [replica(o, model="org/m-7b", served=["m"]) for o in range(3)]
    replicas[2].block_size = 32  # one sidecar keys with another size: the majority wins
    replicas.append(replica(3, model="other", status=DRAINING))
    apply_all(state, snapshot(1, 1, replicas))
    assert state.catalogue.block_size("m") == state.catalogue.block_size("org/m-7b") == 16
    assert (
        state.catalogue.block_size("other") is None
    )  # not routable: nothing announced that counts
    assert state.catalogue.block_size("unknown") is None


def test_views_are_cached_until_something_they_show_changes() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0), replica(1), replica(2, model="other")]))
    view = state.views.view(MODEL)
    first = list(view.replicas())
    assert state.views.view(MODEL) is view
    state.apply(delta(1, 2, loads=[{"ordinal": 2, "load": load(1, 0, ts=5.0)}]))
    unchanged = view.replicas()  # another model's replica changed: same states
    assert len(unchanged) == 2 and all(a is b for a, b in zip(unchanged, first, strict=True))
    state.apply(delta(1, 3, loads=[{"ordinal": 1, "load": load(1, 0, ts=5.0)}]))
    second = view.replicas()
    assert second[0] is first[0]  # only r1 was rebuilt
    assert second[1] is not first[1] and second[1].running == 1
    assert [r.ordinal for r in view.replicas().by_load()] == [0, 1]  # patched in its orders
    state.apply(delta(1, 4, replicas_upserted=[replica(3)]))
    assert state.views.view(MODEL) is not view


# -- config ------------------------------------------------------------------------------


def test_config_from_the_stream_classifies_requests() -> None:
    state = fleet()
    workloads = [
        {"name": "chat", "strategy": "kv_aware", "locality_weight": 0.9},
        {"name": "batch", "strategy": "least_load"},
    ]
    rules = {
        "rules": [{"workload": "batch", "path": "/v1/completions"}],
        "default_workload": "chat",
    }
    apply_all(state, snapshot(1, 1, [replica(0)], routing=config(workloads, rules=rules)))
    routing = state.catalogue.routing_config()
    assert routing.classify(RequestInfo("/v1/completions")).name == "batch"
    chat = routing.classify(RequestInfo("/v1/chat/completions"))
    assert chat == parse_workload(workloads[0])


def test_a_config_the_proxy_cannot_use_is_refused_and_the_last_one_kept() -> None:
    state = fleet()
    good = config([{"name": "default", "strategy": "least_load"}])
    apply_all(state, snapshot(1, 1, [replica(0)], routing=good))
    bad = config([{"name": "default", "strategy": "kv_aware", "locality_weight": 7}], revision=2)
    state.apply(delta(1, 2, config=bad))
    assert state.catalogue.routing_config().workload("default").strategy == "least_load"
    assert "locality_weight" in state.config_error and "revision 2" in state.config_error
    assert state.position() == (1, 2)  # the stream goes on
    state.apply(delta(1, 3, config=config([{"name": "default", "strategy": "round_robin"}])))
    assert state.catalogue.routing_config().workload("default").strategy == "round_robin"
    assert state.config_error == ""


def test_without_workloads_the_default_config_routes() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0)]))
    default = state.catalogue.routing_config().workload("default")
    assert (default.strategy, default.fallback) == ("kv_cost", "prefix_hash")


# -- speculation, in-flight requests, staleness ------------------------------------------


def test_speculative_residency_lands_a_burst_together() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(o) for o in range(4)], {3: [1, 2, 3]}))
    workload = KvAwareWorkload(speculative_ttl_s=2.0)
    chosen = route(state, workload, KEYS, now=10.0).replica_id
    assert state.views.view(MODEL).leading_runs(KEYS, now=10.5) == {int(chosen[1:]): 4}
    assert {route(state, workload, KEYS, now=10.5 + i / 10).replica_id for i in range(5)} == {
        chosen
    }
    assert state.views.view(MODEL).leading_runs(KEYS, now=20.0) == {}  # expired


def test_requests_sent_after_the_engines_report_count_once() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0, running=10, report_ts=100.0), replica(1)]))
    before = [state.inflight.on_sent(0, 99.0) for _ in range(4)]  # the engine's 10 include these
    after = [state.inflight.on_sent(0, 101.0) for _ in range(6)]
    assert state.views.view(MODEL).replicas()[0].requests == 16
    for ticket in after[:2] + before:
        state.inflight.on_done(ticket, 101.5)
    state.inflight.on_done(after[0], 101.6)  # twice: ignored
    # the report's 10 less the 4 it counted that have ended since, and 4 sent after it
    assert state.views.view(MODEL).replicas()[0].requests == 10
    state.apply(delta(1, 2, loads=[{"ordinal": 0, "load": load(12, 0, ts=102.0)}]))
    assert state.views.view(MODEL).replicas()[0].requests == 12  # the report now includes them


def test_requests_the_report_counted_that_have_ended_are_taken_out_of_it() -> None:
    """The engine's report still counts this proxy's requests that ended after it was
    taken: they leave its running figure and their share of its KV usage, so the proxy
    does not read the replica its requests just left as busy as a report period ago (each
    of several proxies then sent its next new prompt to the replica the same stale report
    showed least busy). A request that ended before the report was taken is not in it."""
    state = fleet()
    report = replica(0)
    report.load.CopyFrom(load(4, 0, ts=100.0, kv_usage=0.4))
    apply_all(state, snapshot(1, 1, [report, replica(1)]))
    early = state.inflight.on_sent(0, 98.0)
    state.inflight.on_done(early, 99.5)  # ended before the report: the report left it out
    counted = [state.inflight.on_sent(0, 99.0) for _ in range(2)]
    state.views.view(MODEL).replicas()
    state.inflight.on_done(counted[0], 100.2)
    row = state.views.view(MODEL).replicas()[0]
    assert (row.running, row.requests, row.kv_usage) == (3, 3, pytest.approx(0.3))
    state.apply(delta(1, 2, loads=[{"ordinal": 0, "load": load(1, 0, ts=100.5)}]))
    assert state.views.view(MODEL).replicas()[0].running == 1  # the new report has it right


def test_a_ticket_survives_a_snapshot_that_renumbers_replicas() -> None:
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0, replica_id="a"), replica(1, replica_id="b")]))
    ticket = state.inflight.on_sent(1, 10.0)
    apply_all(state, snapshot(2, 1, [replica(0, replica_id="b"), replica(1, replica_id="a")]))
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [1, 0]
    state.inflight.on_done(ticket)
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [0, 0]


def test_stale_state_sends_kv_strategies_to_their_fallback() -> None:
    clock = Clock()
    state = fleet(clock, max_age_s=30.0)
    assert state.replicas.age_s() == float("inf")
    apply_all(state, snapshot(1, 1, [replica(0), replica(1)], {1: KEYS}))
    workload = KvAwareWorkload(speculative_ttl_s=0)
    assert route(state, workload, KEYS).replica_id == "r1"
    clock.now += 30.0  # as old as allowed: still fresh
    assert not state.replicas.is_stale()
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {1: len(KEYS)}
    clock.now += 1.0
    assert state.replicas.age_s() == 31.0 and state.replicas.is_stale()
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {}
    decision = route(state, workload, KEYS)
    assert decision.note.startswith("no residency data: fallback")
    state.apply(delta(1, 2))  # an empty delta is a heartbeat
    assert state.replicas.age_s() == 0.0 and not state.replicas.is_stale()


BOOKKEEPING = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(0, 2)),
        st.tuples(st.just("done"), st.integers(0, 30)),
        st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 9)),
        st.tuples(st.just("upsert"), st.integers(0, 2), st.integers(1, 99)),
        st.tuples(st.just("upsert mid-delta"), st.integers(0, 2), st.integers(1, 99)),
        st.tuples(st.just("read")),  # routing reads the fleet (what changed is rebuilt)
        st.tuples(st.just("answered"), st.integers(0, 30)),  # first bytes: prefill settled
        st.tuples(st.just("tick"), st.sampled_from([0.001, 0.05, 1.0])),  # booked work drains
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=BOOKKEEPING, books=st.booleans())
def test_states_rebuilt_from_the_current_state_equal_states_rebuilt_from_the_records(
    ops: list[tuple[Any, ...]], books: bool
) -> None:
    """A replica whose only change is this proxy's counts gets its new state from its
    current one: the same states (and so decisions) as rebuilding each from its record,
    across requests sent and ended, load reports, and replicas upserted (read between a
    delta's steps too), with and without prefill books (a kv_cost workload)."""
    clock = Clock()
    fast, full = FleetState(clock=clock), FleetState(clock=clock, views=RebuildingViews)
    tickets: dict[FleetState, list[Any]] = {fast: [], full: []}
    version = 1
    kv_cost = [{"name": "default", "strategy": "kv_cost", "prefill_tokens_per_s": 1_000}]
    routing = config(kv_cost) if books else None
    for state in (fast, full):
        apply_all(state, snapshot(1, 1, [replica(0), replica(1), replica(2)], routing=routing))
    for op in ops:
        kind = op[0]
        version += kind in ("report", "upsert", "upsert mid-delta")  # a delta's version
        if kind == "upsert mid-delta":
            upsert = [replica(op[1], capacity=op[2])]
            added = [residency_change(op[1], added=KEYS)]  # a step to yield after
            body = delta(1, version, replicas_upserted=upsert, residency=added)
            steps = [fast.apply_steps(body), full.apply_steps(body)]
            for step in steps:
                next(step)  # the replica upserted, the delta not ended: routing reads
            assert _states(fast) == _states(full)
            for step in steps:
                for _ in step:
                    pass
        for state in (fast, full):
            if kind == "send":
                tickets[state].append(state.inflight.on_sent(op[1], 100.0 + version, 500))
            elif kind == "answered" and tickets[state]:
                state.inflight.on_first_byte(
                    tickets[state][op[1] % len(tickets[state])], 200, False
                )
            elif kind == "done" and tickets[state]:
                ticket = tickets[state].pop(op[1] % len(tickets[state]))
                state.inflight.on_done(ticket, 100.0 + version)
            elif kind == "report":
                report = load(op[2], 0, ts=100.0 + version - 0.5)
                state.apply(delta(1, version, loads=[{"ordinal": op[1], "load": report}]))
            elif kind == "upsert":
                upsert = [replica(op[1], capacity=op[2])]
                state.apply(delta(1, version, replicas_upserted=upsert))
        if kind == "tick":
            clock.now += op[1]
        if kind == "read":
            assert _states(fast) == _states(full)
    assert _states(fast) == _states(full)


class RebuildingViews(ViewCache):
    """The oracle: every changed replica's state rebuilt from its record, as before."""

    def _flush(self) -> None:
        records, states = self.table.records, self.table.states
        for ordinal in self._dirty:
            record = records.get(ordinal)
            if record is None:
                continue
            counts = self._counts(record)
            current = states[ordinal]
            if ordinal not in self._reloaded and counts == (
                current.unreported,
                record.ended,
                current.queued_prefill_tokens,
                current.prefill_tokens_per_s,
                current.extra_step_s,
            ):
                continue
            state = states[ordinal] = self._replica_state(record, counts)
            for view in self._views.values():
                view._replace(state)
        self._dirty.clear()
        self._reloaded.clear()


def _states(state: FleetState) -> list[tuple[Any, ...]]:
    return [(r, r.requests, r.load) for r in state.views.view(MODEL).replicas()]


# -- static mode ---------------------------------------------------------------------------


def test_static_replicas_route_without_a_control_plane() -> None:
    state = FleetState.from_static(["http://127.0.0.1:8101/", "http://127.0.0.1:8102"])
    assert ids(state, "anything") == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert state.catalogue.canonical_model("anything") == "anything"
    assert state.replicas.endpoint(0).base_url == "http://127.0.0.1:8101"  # type: ignore[union-attr]
    state.set_served_names(0, ["m", "m-alias"])
    state.set_served_names(1, ["other"])
    assert ids(state, "m-alias") == ["127.0.0.1:8101"]
    assert state.catalogue.canonical_model("m-alias") == "m"
    assert state.catalogue.canonical_model("anything") is None
    assert state.catalogue.served_models() == ["m", "m-alias", "other"]
    workload = KvAwareWorkload(fallback="prefix_hash")
    decision = route(state, workload, KEYS)
    assert decision.replica_id == "127.0.0.1:8101" and "fallback prefix_hash" in decision.note


def test_a_request_routed_while_a_leaving_replica_is_cleared_sees_the_fleet_as_it_was() -> None:
    """One of this proxy's requests went to r1, then a delta removes r1 and is applied in
    steps (its residency cleared between them); a request routed in between, /v1/models
    and /readyz read the fleet as before the delta (r1 has no endpoint left), not an
    error. Both for a view built before the delta and one built during it."""
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0), replica(1)], {1: KEYS * 600}))
    assert ids(state) == ["r0", "r1"]
    ticket = state.inflight.on_sent(1, 5000.0)
    steps = state.apply_steps(delta(1, 2, replicas_removed=[1]))
    next(steps)
    assert ids(state) == ["r0", "r1"]
    state.views._views.clear()  # as if no request had been routed since the snapshot
    assert ids(state) == ["r0", "r1"]
    assert state.catalogue.canonical_model(MODEL) == MODEL and state.catalogue.served_models() == [
        MODEL
    ]
    assert [e.replica_id for e in state.replicas.endpoints()] == ["r0"]
    for _ in steps:
        pass
    state.inflight.on_done(ticket)
    assert ids(state) == ["r0"]


def test_a_request_that_came_and_went_leaves_nothing_for_the_next_one_to_rebuild() -> None:
    """Its end settles its replica's state at once (the next request's routing reads the
    view without a rebuild on its critical path); one still in flight does not. (Without
    prefill books: with a kv_cost workload the queue drains with time, read when routed.)"""
    state = fleet()
    routing = config([{"name": "default", "strategy": "kv_aware"}])
    replicas = [replica(0, running=2, report_ts=100.0), replica(1)]
    apply_all(state, snapshot(1, 1, replicas, routing=routing))
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [2, 0]
    ticket = state.inflight.on_sent(0, 101.0)
    state.inflight.on_done(ticket)
    assert not state.views._dirty
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [2, 0]
    first, second = state.inflight.on_sent(0, 101.0), state.inflight.on_sent(0, 101.0)
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [4, 0]
    state.inflight.on_done(first)
    assert state.views._dirty == {0}  # the state shows 2 unreported, one is left
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [3, 0]
    state.inflight.on_done(second)
    assert [r.requests for r in state.views.view(MODEL).replicas()] == [2, 0]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["sent", "first_byte", "done", "read", "report", "tick"]),
        st.integers(0, 2),
        st.integers(0, 3),
    ),
    max_size=40,
)


class _RebuiltOnRead(ViewCache):
    """The reference: an ended request marks its replica for a rebuild when next read."""

    def settle(self, ordinal: int, record: Any) -> None:
        self.refresh(ordinal)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, books=st.booleans())
def test_what_routing_reads_is_what_a_rebuild_on_read_gives(
    ops: list[tuple[str, int, int]], books: bool
) -> None:
    """Whatever mix of sends, answers, ends, load reports, reads and time passing, with or
    without prefill books (whose figure drains with time), every replica state routing
    reads is the one a proxy rebuilding each ended request's replica on the next read
    shows; without books, also one built afresh from the records at that moment."""
    clock = Clock()
    workloads = [{"name": "default", "strategy": "kv_cost", "prefill_tokens_per_s": 1_000}]
    routing = config(workloads if books else [{"name": "default", "strategy": "kv_aware"}])
    replicas = [replica(o, running=1, report_ts=100.0) for o in range(3)]
    states = [FleetState(clock=clock), FleetState(clock=clock, views=_RebuiltOnRead)]
    for state in states:
        apply_all(state, snapshot(1, 1, replicas, routing=routing))
    tickets: list[list[Any]] = [[], []]
    version = 1
    for op, ordinal, n in ops:
        if op == "report":
            version += 1
        for state, sent in zip(states, tickets, strict=True):
            if op == "sent":
                sent.append(state.inflight.on_sent(ordinal, 100.0 + n, uncached_tokens=n * 10))
            elif op == "first_byte" and sent:
                state.inflight.on_first_byte(sent[n % len(sent)], 200, streaming=bool(n % 2))
            elif op == "done" and sent:
                state.inflight.on_done(sent.pop(n % len(sent)))
            elif op == "report":
                update = {"ordinal": ordinal, "load": load(n, 0, ts=100.0 + n)}
                state.apply(delta(1, version, loads=[update]))
        if op == "tick":
            clock.now += n * 0.004
        if op != "read" and n % 2:
            continue  # reads between some steps only: the marks pile up in between
        read, reference = (list(state.views.view(MODEL).replicas()) for state in states)
        assert read == reference, op
        if not books:
            fresh = states[0].views._replica_state
            assert read == [fresh(states[0].replicas.records[r.ordinal]) for r in read]


def test_a_view_counts_this_proxys_requests_in_flight_to_its_own_replicas() -> None:
    """What the hot-prefix rule compares with the engines' counts to tell what share of
    the fleet's traffic this proxy sees: its requests to the model's replicas, not to
    another model's, until they end."""
    state = fleet()
    apply_all(state, snapshot(1, 1, [replica(0), replica(1), replica(2, model="other")]))
    now = 1000.0
    first, _, _ = (
        state.inflight.on_sent(0, now),
        state.inflight.on_sent(1, now),
        state.inflight.on_sent(2, now),
    )
    assert state.views.view(MODEL).inflight() == 2
    assert state.views.view("other").inflight() == 1
    state.inflight.on_done(first)
    assert state.views.view(MODEL).inflight() == 1
