"""The proxy's request path compiled to C with mypyc, and whether a checkout's build is
current.

The modules in :data:`MODULES` are what a routed request runs through: the HTTP server,
the handler, the exchange with the replica, request parsing, routing, the requests
upstream, the fleet state, the HTTP client, the metrics, the circuit breakers, the
first-byte deadlines and the prefill books, and the kvcore modules that earn their keep
compiled (``python -m bench.native_groups``): keys, prompt reading, built-in tokenizer
and prefix cache (the keying), the routing contract, replica board, in-flight ledger,
screening, view, hash ring and the level-0, -2 and -3 policies, and the dict residency
index (its lookups of long prompts are dict probes, no faster compiled, but a request's
speculative record, which the compact index keeps in one, and a short prompt's lookup
cost 2-3x less compiled). :data:`C_MODULES` are written in C (the
compact residency index's prompt lookup, kvcore/index/_probe.c). ``setup.py`` compiles
them when ``KVROUTE_NATIVE=1`` (the images are built so; in a checkout, ``make native``,
which ``make test`` runs first), and an extension module sitting beside its source is
what Python imports. Compiled, the request path costs about 40% less CPU in process
(docs/benchmarks.md, "Compiled modules"); the code is the same either way, and a
checkout without a C compiler runs it from source.

A checkout's compiled modules go stale when a source changes: :func:`stale` lists them
(``make native`` rebuilds, ``make clean-native`` removes), and the test suite refuses to
run on them. A compiled module behaves as Python runs it only within what mypyc keeps:
no name bound by two ``except`` clauses of different types in one function (it keeps the
first one's type, and the second exception becomes a ``TypeError``:
tests/unit/dataplane/test_native.py checks), no attribute tested again after an
``await`` that a test before it narrowed (the narrowing holds: read it through a
method), no ``is`` on tuples (they may be boxed anew), no ``isinstance`` against a
compiled class with an ABC base (it shares the ABC's registry), no method aliased in a
class body (``b = a`` leaves a ``KeyError`` pending), no plain class attribute a
subclass overrides (the base's compiled methods read the base's value: declare it
``ClassVar``), no replacing a compiled object's methods, and no subclass of a compiled
class unless it allows one (``mypyc_attr(allow_interpreted_subclasses=True)``); mypyc
compiles no async generator and no subclass of a built-in exception
(``mypyc_attr(native_class=False)`` leaves such a class plain Python), and no method
``@dataclass`` generates: a dataclass a request builds writes its own ``__init__``, taking
its fields in order (tests/unit/dataplane/test_native.py checks that it does, and
tests/unit/bench/test_proxy_path.py that no generated one runs for a routed request).
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

MODULES = (
    "dataplane.app",
    "dataplane.breaker",
    "dataplane.exchange",
    "dataplane.first_byte",
    "dataplane.fleet.catalogue",
    "dataplane.fleet.inflight",
    "dataplane.fleet.prefill_books",
    "dataplane.fleet.replicas",
    "dataplane.fleet.state",
    "dataplane.fleet.views",
    "dataplane.metrics",
    "dataplane.openai_request",
    "dataplane.routing",
    "dataplane.transport.client",
    "dataplane.transport.server",
    "dataplane.upstream",
    "kvcore.index.bitmask",
    "kvcore.keys",
    "kvcore.policies.base",
    "kvcore.policies.board",
    "kvcore.policies.hash_ring",
    "kvcore.policies.inflight",
    "kvcore.policies.kv_aware",
    "kvcore.policies.kv_cost",
    "kvcore.policies.kv_scoring",
    "kvcore.policies.least_load",
    "kvcore.policies.prefix_hash",
    "kvcore.policies.preselect",
    "kvcore.policies.round_robin",
    "kvcore.policies.screening",
    "kvcore.policies.view",
    "kvcore.request",
    "kvcore.tokenize.builtin",
    "kvcore.tokenize.prefix_cache",
)
# modules written in C (their source the ``.c`` file of their name), built with the others
C_MODULES = ("kvcore.index._probe",)
GROUP = "dataplane._native"  # the C library the compiled modules share (``GROUP__mypyc``)
_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("dataplane", "kvcore")  # whose sources the compiled modules are built against
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def compiled() -> list[str]:
    """The modules of :data:`MODULES` this process imported compiled."""
    return [
        name
        for name in MODULES
        if (module := sys.modules.get(name)) is not None
        and str(getattr(module, "__file__", "")).endswith(_EXTENSIONS)
    ]


def built(root: Path = _ROOT) -> list[str]:
    """The modules of :data:`MODULES` and :data:`C_MODULES` with a compiled module beside
    their source."""
    return [name for name in (*MODULES, *C_MODULES) if _extension(root, name) is not None]


def stale(root: Path = _ROOT) -> list[str]:
    """Compiled modules Python would import though a source changed after they were
    built, and compiled modules of the package no longer in :data:`MODULES`. Any module of
    ``dataplane`` or ``kvcore`` counts, not only a compiled one's own: mypyc compiles a
    module against the types of what it imports, and checks them at run time."""
    extensions = {name: path for name in MODULES if (path := _extension(root, name))}
    files = sorted(path for package in _PACKAGES for path in (root / package).rglob("*"))
    out: list[str] = []
    if extensions:
        built_at = min(path.stat().st_mtime for path in extensions.values())
        sources = (path for path in files if path.suffix == ".py")
        if any(path.stat().st_mtime > built_at for path in sources):
            out.extend(extensions)
    for name in C_MODULES:
        path = _extension(root, name)
        if path is not None and c_source(name, root).stat().st_mtime > path.stat().st_mtime:
            out.append(name)
    known = {*MODULES, *C_MODULES, f"{GROUP}__mypyc"}
    for path in files:
        if path.name.endswith(_EXTENSIONS):
            name = ".".join(path.relative_to(root).with_name(path.name.split(".")[0]).parts)
            if name not in known:
                out.append(name)
    return out


def source(name: str, root: Path = _ROOT) -> Path:
    """The source file of module ``name`` under ``root``."""
    return root.joinpath(*name.split(".")).with_suffix(".py")


def c_source(name: str, root: Path = _ROOT) -> Path:
    """The C source file of module ``name`` (one of :data:`C_MODULES`) under ``root``."""
    return root.joinpath(*name.split(".")).with_suffix(".c")


def _extension(root: Path, name: str) -> Path | None:
    source_path = source(name, root)
    for suffix in _EXTENSIONS:
        path = source_path.with_name(source_path.stem + suffix)
        if path.exists():
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m dataplane.native``: exit 0 when every module is compiled and current,
    else 1, saying which are not (``make native`` builds when this fails)."""
    quiet = "--quiet" in (argv if argv is not None else sys.argv[1:])
    missing = sorted({*MODULES, *C_MODULES} - set(built()))
    old = stale()
    if not quiet:
        for name in missing:
            print(f"{name}: not compiled")
        for name in old:
            print(f"{name}: compiled before a source changed (or no longer listed)")
        if not missing and not old:
            print(f"{len(MODULES)} modules compiled and current")
    return 1 if missing or old else 0


if __name__ == "__main__":
    sys.exit(main())
