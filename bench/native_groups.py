"""Which compiled kvcore modules earn their keep: the proxy's CPU figures with each group
of kvcore modules compiled or not, side by side in one run.

``python -m bench.native_groups --work DIR [--rounds N] [--out DIR]`` copies this
checkout's committed tree (``git archive HEAD``) into ``DIR`` once per variant of
:data:`VARIANTS` (nothing compiled; the dataplane modules alone; every module of
``dataplane/native.py`` but one kvcore group; every module; every module and the dict
residency index, which it leaves out), compiles each with mypyc as
``make native`` does, then times in each variant, round by round in turn so that the
machine's phases weigh on every variant alike, in CPU (thread) time:

- the routing decision (``Router.prepare`` + ``choose``, ``kv_aware``, 64 replicas,
  built-in tokenizer) for 300 chats whose first 90% was seen before and for 300 chats
  never seen before (``bench.micro tokenize``'s figures);
- one ``select`` per strategy over 64 replicas and a 512-block prompt
  (``bench.micro policies``);
- ``kv_aware``'s shortcuts against its general path (``select_scored``) on the same
  decisions: a held 512-block prompt and a prompt under a block;
- the proxy's own work per request in process (``bench.proxy_path``): ``kv_aware`` on
  shared-prefix prompts (its keyed path) and ``round_robin`` on short ones.

Each variant's process checks that it imported compiled exactly its variant's modules.
Printed: each figure's median over the rounds per variant, and its ratio to the variant
with every module compiled; ``--out`` gets the rounds as JSON and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dataplane.native import MODULES

KEYING = (
    "kvcore.keys",
    "kvcore.request",
    "kvcore.tokenize.builtin",
    "kvcore.tokenize.prefix_cache",
)
INDEX = ("kvcore.index.bitmask",)  # the dict residency index
POLICIES = tuple(m for m in MODULES if m.startswith("kvcore.policies."))
DATAPLANE = tuple(m for m in MODULES if m.startswith("dataplane."))


def _without(*groups: tuple[str, ...]) -> tuple[str, ...]:
    left = set(MODULES).difference(*groups)
    return tuple(m for m in MODULES if m in left)


VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "dataplane only": DATAPLANE,
    "all but keying": _without(KEYING),
    "all but policies": _without(POLICIES),
    "all": MODULES,
    "all + dict index": (*MODULES, *INDEX),  # left out of MODULES: no faster compiled
}
ROOT = Path(__file__).resolve().parent.parent


def _slug(name: str) -> str:
    return name.replace(" ", "-")


def build(work: Path, name: str, modules: tuple[str, ...]) -> Path:
    """The tree of variant ``name`` under ``work``, its ``modules`` compiled."""
    tree = work / _slug(name)
    if (tree / ".built").exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    native = tree / "dataplane" / "native.py"
    text = native.read_text()
    start, end = text.index("MODULES = ("), text.index(")\n", text.index("MODULES = (")) + 2
    listed = "".join(f'    "{m}",\n' for m in modules)
    native.write_text(f"{text[:start]}MODULES: tuple[str, ...] = (\n{listed}){text[end - 1 :]}")
    if modules:
        env = {**os.environ, "KVROUTE_NATIVE": "1"}
        log = tree / "build-native.log"
        command = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"]
        with log.open("w") as out:
            subprocess.run(
                command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, check=True
            )
    (tree / ".built").write_text(",".join(modules))
    return tree


def measure() -> dict[str, float]:
    """This process's figures (run inside a variant's tree), in microseconds."""
    import uvloop

    from bench.micro import policies_bench
    from bench.micro.tokenize_bench import _decisions_cpu
    from bench.proxy_path import measure as proxy_path
    from kvruntime.gc_tuning import tune_gc

    out: dict[str, float] = {}
    for new in (False, True):
        seen = "new 2048-token chats" if new else "chats 90% seen"
        p50, p99, _ = _decisions_cpu(new_prompts=new)
        out[f"decision, {seen}, p50"] = p50.value * 1000
        out[f"decision, {seen}, p99"] = p99.value * 1000
    for figure in policies_bench.run():
        if figure.name.startswith("select, "):
            out[figure.name.split(",")[1].strip() + " select (512 blocks)"] = figure.value
    out.update(_kv_aware_paths())
    tune_gc()
    for strategy, prompt in (("kv_aware", "shared"), ("round_robin", "hello")):
        samples = uvloop.run(proxy_path(5000, strategy, False, debug_headers=False, prompt=prompt))
        out[f"proxy path, {strategy}, {prompt} prompt (median batch)"] = statistics.median(samples)
    return out


def _kv_aware_paths() -> dict[str, float]:
    """``kv_aware``'s two shortcuts against its general path (``select_scored``) on the
    same decisions: a prompt replicas hold (512 blocks) and a prompt shorter than a block."""
    import random
    from functools import partial

    from bench.micro.policies_bench import MODEL, PROMPT_TOKENS, _view
    from bench.micro.report import median_us
    from kvcore.keys import block_keys
    from kvcore.policies import RouteContext, create_policy
    from kvcore.policies.kv_scoring import KvScoringPolicy
    from kvcore.workload import parse_workload

    rng = random.Random(9)
    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    keys = block_keys(tokens, model=MODEL)
    view = _view(rng, keys)
    workload = parse_workload({"strategy": "kv_aware", "speculative_ttl_s": 0})
    policy = create_policy(workload, rng=random.Random(1))
    assert isinstance(policy, KvScoringPolicy)
    out = {}
    for name, ctx in (
        ("held 512-block prompt", RouteContext(workload, MODEL, keys, tokens, now=1.0)),
        ("prompt under a block", RouteContext(workload, MODEL, [], tokens[:5], now=1.0)),
    ):
        for path, select in (("select", policy.select), ("general path", policy.select_scored)):
            out[f"kv_aware {path}, {name}"] = median_us(partial(select, ctx, view), repeat=300)
    return out


def _child(tree: Path, expected: str) -> dict[str, float]:
    code = (
        "import json, sys\n"
        "from bench.native_groups import measure\n"
        "figures = measure()\n"
        "from dataplane.native import compiled\n"
        "print(json.dumps({'compiled': ','.join(sorted(compiled())), 'figures': figures}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    want = ",".join(sorted(expected.split(","))) if expected else ""
    if result["compiled"] != want:
        raise RuntimeError(
            f"{tree.name} imported compiled {result['compiled']!r}, not {expected!r}"
        )
    figures: dict[str, float] = result["figures"]
    return figures


def render(rounds: list[dict[str, dict[str, float]]]) -> str:
    names = list(VARIANTS)
    figures = list(rounds[0]["all"])
    median = {v: {f: statistics.median(r[v][f] for r in rounds) for f in figures} for v in names}
    width = max(len(f) for f in figures)
    lines = [f"{'figure (us, median of ' + str(len(rounds)) + ' rounds)':{width}s}  "
             + "  ".join(f"{v:>16s}" for v in names)]  # fmt: skip
    for f in figures:
        cells = [f"{median[v][f]:8.1f} ({median[v][f] / median['all'][f]:4.2f}x)" for v in names]
        lines.append(f"{f:{width}s}  " + "  ".join(f"{c:>16s}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="where the variants' trees go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="a directory for the results")
    args = parser.parse_args(argv)
    trees = {}
    for name, modules in VARIANTS.items():
        started = time.monotonic()
        trees[name] = build(args.work, name, modules)
        print(f"built {name} ({len(modules)} modules) in {time.monotonic() - started:.0f} s",
              file=sys.stderr)  # fmt: skip
    load = [os.getloadavg()]
    rounds: list[dict[str, dict[str, float]]] = []
    for index in range(args.rounds):
        order = list(VARIANTS) if index % 2 == 0 else list(reversed(VARIANTS))
        rounds.append({v: _child(trees[v], ",".join(VARIANTS[v])) for v in order})
        load.append(os.getloadavg())
        print(f"round {index + 1} done, load average {load[-1][0]:.1f}", file=sys.stderr)
    table = render(rounds)
    loads = [round(a[0], 1) for a in load]
    print(table)
    print(f"load average (1 min) at the start and after each round: {loads}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        variants = {v: list(m) for v, m in VARIANTS.items()}
        result = {"variants": variants, "rounds": rounds, "load_average": loads}
        (args.out / "native-groups.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "table.txt").write_text(f"{table}\nload average: {loads}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
