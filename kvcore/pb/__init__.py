"""Generated protobuf modules for proto/kvroute/v1 (see scripts/gen_proto.py)."""
