"""The control plane's fleet half: NATS in, the fleet and its residency, the routing state out.

Ingest applies the sidecars' streams to the :class:`~controlplane.fleet.fleet.Fleet`;
the broadcaster and the gRPC ``RoutingState`` server stream it to the proxies;
leadership keeps the shard's membership and drain flags in etcd. It meets the records
half only through :mod:`controlplane.contracts`.
"""
