"""Entry point of `kvroute-proxy`: the OpenAI-compatible data-plane proxy."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="kvroute-proxy",
        description="kvroute: the OpenAI-compatible data-plane proxy.",
        epilog="Not implemented yet: see the open issues.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help()
    return 0
