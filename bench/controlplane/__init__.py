"""Control-plane benchmarks (``python -m bench.controlplane``) and their minimal watcher."""
