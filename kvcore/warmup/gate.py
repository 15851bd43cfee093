"""Which warming replicas a request must not go to (applied before the workload's policy).

While a replica warms it takes only a share of *new* prefixes, those no replica holds
yet (as smg's ``--worker-warmup-share`` offers a warming worker a share of cache
misses), and what it holds already (confirmed by its KV events: a hit there as
anywhere). It takes no request whose prefix only other replicas hold (a miss there,
which the warm-up is about to spare), and none starting with a prefix it is being
warmed with (``pending`` keys: planned or sent, not confirmed): sent there before the
warm-up's prefill lands, the request would compute it again. The requests it takes wait
behind the warm-up's prefills, so when the warm-up ends the proxies forget the prefill
rate they learned of it meanwhile (``kv_cost`` would otherwise rank it slow for long).

When the gate would leave no replica, the caller ignores it: warming never refuses a
request.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def warming_excluded(
    pending: Mapping[int, Collection[int]],
    keys: Sequence[int],
    runs: Mapping[int, int],
    share: float,
    draw: float,
) -> frozenset[int]:
    """The warming replicas (``pending``: ordinal -> keys being warmed there) that must
    not take a request with block ``keys`` whose leading runs are ``runs``; ``draw`` is a
    uniform number in [0, 1) (one per request)."""
    if not pending:
        return frozenset()
    new = not any(run > 0 for run in runs.values())
    excluded = []
    for ordinal, warming_keys in pending.items():
        if _starts_with_any(keys, warming_keys):
            excluded.append(ordinal)  # being warmed with it: not until confirmed
        elif runs.get(ordinal, 0) > 0:
            continue  # it holds the prompt's beginning (confirmed): a hit as anywhere
        elif not new or draw >= share:
            excluded.append(ordinal)
    return frozenset(excluded)


def _starts_with_any(keys: Sequence[int], warming_keys: Collection[int]) -> bool:
    return bool(warming_keys) and any(key in warming_keys for key in keys)
