"""Entry point of `kvroute-controlplane`: the control plane."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="kvroute-controlplane",
        description="kvroute: the control plane (residency, membership, config, admin API, gRPC).",
        epilog="Not implemented yet: see the open issues.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help()
    return 0
