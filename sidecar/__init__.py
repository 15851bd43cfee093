"""kvroute sidecar: engine KV events and load, translated to router keys, published on NATS."""
