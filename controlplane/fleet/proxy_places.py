"""A place for each proxy watching the shard: 0, 1, 2, ..., told in its watch's metadata.

Proxies behind one round-robin balancer each take every Nth request, so while new prompts
arrive their turns for new prompts advance in step; ``kv_aware`` and ``kv_cost`` start a
router's turn at its place (:meth:`kvcore.policies.kv_scoring.KvScoringPolicy.take_place`),
so that no two start at the same replica. A Deployment's pods are all alike, so the
control plane numbers them: a watch takes the lowest number free across the shard's
instances, as the etcd key ``shards/<shard>/proxies/<n>`` (the proxy's id) created if
absent on this instance's lease, and gives it back when the watch ends; an instance that
dies takes its numbers with its lease.

A place is a hint, never a reason to delay routing state: when etcd does not answer
within :data:`PLACE_TIMEOUT_S` the watch goes on without one, and the proxy starts its
turn at a random replica, as a proxy with no control plane does. A proxy started with
``--proxy-index`` keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from itertools import count

import aetcd
from aetcd.leases import Lease

from kvcore.subjects import EtcdKeys
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 1.0
"""How long a watch waits for etcd to number it before it goes on without a place."""
_TRIES = 8  # numbers tried when other instances take the same one at the same time


class ProxyPlaces:
    """Numbers the proxies watching this shard's control planes, through etcd."""

    def __init__(self, etcd: aetcd.Client, keys: EtcdKeys, shard: str, ttl_s: int) -> None:
        self.etcd = etcd
        self._prefix = keys.proxy_places_prefix(shard)
        self._ttl_s = ttl_s
        self._lease: Lease | None = None
        self._tasks = BackgroundTasks()

    async def take(self, proxy_id: str) -> int | None:
        """The lowest place free across the shard for ``proxy_id``'s watch, or ``None``
        when etcd did not number it in time."""
        try:
            async with asyncio.timeout(PLACE_TIMEOUT_S):
                return await self._take(proxy_id)
        except (TimeoutError, aetcd.ClientError) as exc:
            log.info("watch goes on without a place", extra={"error": type(exc).__name__})
            return None

    def give_back(self, place: int) -> None:
        """The watch holding ``place`` ended (never blocks: the key is deleted in the
        background)."""
        self._tasks.spawn(self._delete(place), name="proxy-place-back")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        lease, self._lease = self._lease, None
        if lease is not None:  # the numbers go at once, not after the TTL
            with contextlib.suppress(aetcd.ClientError):
                await lease.revoke()

    async def _take(self, proxy_id: str) -> int | None:
        lease = await self._current_lease()
        txn = self.etcd.transactions
        for _ in range(_TRIES):
            found = await self.etcd.get_prefix(self._prefix.encode())
            taken = {
                int(n) for kv in found if (n := kv.key.decode()[len(self._prefix) :]).isdigit()
            }
            place = next(n for n in count() if n not in taken)
            key = f"{self._prefix}{place}".encode()
            won, _ = await self.etcd.transaction(
                compare=[txn.create(key) == 0],
                success=[txn.put(key, proxy_id.encode(), lease)],
                failure=[],
            )
            if won:
                return place
        return None

    async def _current_lease(self) -> Lease:
        if self._lease is None:
            self._lease = await self.etcd.lease(self._ttl_s)
            self._tasks.spawn(self._keep(self._lease), name="proxy-places-lease")
        return self._lease

    async def _keep(self, lease: Lease) -> None:
        """Refresh ``lease`` every third of its TTL; when it is lost, the next watch makes
        a new one (the numbers on the old one are gone with it)."""
        refresh = lease.refresh
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            if self._lease is not lease:
                return
            try:
                reply = await refresh()
            except aetcd.ClientError:
                reply = None
            if reply is None or reply.TTL <= 0:
                if self._lease is lease:
                    self._lease = None
                return

    async def _delete(self, place: int) -> None:
        with contextlib.suppress(aetcd.ClientError):
            await self.etcd.delete(f"{self._prefix}{place}".encode())
