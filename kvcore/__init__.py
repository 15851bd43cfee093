"""kvcore: the pure core every kvroute component shares.

Block keys, tokenization, the residency index, routing policies, the workload model,
NATS subject and etcd key names, and the protobuf messages. Nothing here performs I/O or
imports asyncio, a network, web or database library (an import-linter contract keeps it
so), which is what lets the sidecar, control plane, proxy and benchmark simulator run the
very same code.
"""
