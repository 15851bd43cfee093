"""The `kvroute` command: a local fleet (`up`), benchmarks and explain."""
