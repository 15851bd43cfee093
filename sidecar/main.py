"""Entry point of `kvroute-sidecar`: the sidecar that runs beside one engine replica."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="kvroute-sidecar",
        description="kvroute: the sidecar that runs beside one engine replica.",
        epilog="Not implemented yet: see the open issues.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help()
    return 0
