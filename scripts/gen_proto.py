"""Generate the Python modules for proto/kvroute/v1/*.proto into kvcore/pb/.

The .proto files import each other as ``kvroute/v1/x.proto``, so protoc writes
``from kvroute.v1 import x_pb2``; that package name is the launcher's, so the imports are
rewritten to ``kvcore.pb``. Only message modules are generated: the one gRPC method is
bound by name in the control plane and the proxy (see docs/architecture.md), which keeps
kvcore free of grpc.

Usage: python scripts/gen_proto.py [--check]
  --check  regenerate into a temporary folder and fail if anything differs.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "kvcore" / "pb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi")


def generate(dest: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.glob("kvroute/v1/*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}"]
        args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        produced = []
        for path in sorted(Path(tmp, "kvroute", "v1").iterdir()):
            text = path.read_text().replace("from kvroute.v1 import", "from kvcore.pb import")
            target = dest / path.name
            target.write_text(text)
            produced.append(target)
    return produced


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    check = parser.parse_args().check
    if not check:
        for old in OUT.iterdir():
            if old.name.endswith(GENERATED_SUFFIXES):
                old.unlink()
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name for p in generate(Path(tmp))}
        committed = {p.name for p in OUT.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        stale = sorted(fresh ^ committed)
        stale += sorted(
            n for n in fresh & committed if not filecmp.cmp(Path(tmp, n), OUT / n, False)
        )
    if stale:
        print("generated protobuf modules are out of date: " + ", ".join(stale), file=sys.stderr)
        print("run `make proto` and commit the result", file=sys.stderr)
        return 1
    print("protobuf modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
