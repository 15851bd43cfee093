"""``python -m bench.micro``: every micro benchmark, each figure beside its target."""

from __future__ import annotations

import sys
import time

from bench.micro import index_bench, keys_bench, policies_bench, state_bench, tokenize_bench
from bench.micro.report import Figure, render

BENCHMARKS = {
    "keys": keys_bench.run,
    "tokenize": tokenize_bench.run,
    "index": index_bench.run,
    "policies": policies_bench.run,
    "state": state_bench.run,
}


def main(argv: list[str]) -> int:
    """Run the named benchmarks (all by default); exit 1 when a target is missed."""
    names = argv or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    figures: list[Figure] = []
    for name in names:
        started = time.perf_counter()
        figures += BENCHMARKS[name]()
        print(f"[{name}: {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    print(render(figures))
    return 1 if any(f.verdict == "MISSED" for f in figures) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
