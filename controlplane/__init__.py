"""kvroute control plane: residency map, membership, routing config (etcd), admin API, gRPC."""
