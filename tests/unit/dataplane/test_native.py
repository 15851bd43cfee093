"""A checkout's compiled request path never hides a newer source (dataplane/native.py)."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

from dataplane import native

SUFFIX = native._EXTENSIONS[0]
IMPORTED = Path("kvcore", "policies", "base.py")  # imported by compiled modules, not one


def _checkout(tmp_path: Path) -> Path:
    """A checkout with every listed module's source, each compiled a second after it,
    and a module they import that is not compiled."""
    for name in native.MODULES:
        source = native.source(name, tmp_path)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        extension = source.with_name(source.stem + SUFFIX)
        extension.write_bytes(b"")
        os.utime(source, (1_000, 1_000))
        os.utime(extension, (1_001, 1_001))
    (tmp_path / IMPORTED).write_text("")
    os.utime(tmp_path / IMPORTED, (1_000, 1_000))
    (tmp_path / "dataplane" / f"_native__mypyc{SUFFIX}").write_bytes(b"")
    return tmp_path


def test_a_build_newer_than_every_source_is_current(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    assert native.built(root) == list(native.MODULES)
    assert native.stale(root) == []


def test_a_source_edited_after_its_build_makes_the_build_stale(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    os.utime(root / "dataplane" / "routing.py", (2_000, 2_000))
    assert native.stale(root) == list(native.MODULES)


def test_a_module_the_compiled_ones_import_edited_after_the_build_makes_it_stale(
    tmp_path: Path,
) -> None:
    """Compiled code checks the types of what it calls as they were at the build."""
    root = _checkout(tmp_path)
    os.utime(root / IMPORTED, (2_000, 2_000))
    assert native.stale(root) == list(native.MODULES)


def test_a_compiled_module_no_longer_listed_is_stale(tmp_path: Path) -> None:
    """Python would still import it instead of its source."""
    root = _checkout(tmp_path)
    (root / "dataplane" / "relay.py").write_text("")
    (root / "dataplane" / f"relay{SUFFIX}").write_bytes(b"")
    (root / "kvcore" / "policies" / f"session_affinity{SUFFIX}").write_bytes(b"")
    os.utime(root / "dataplane" / "relay.py", (1_000, 1_000))
    assert native.stale(root) == ["dataplane.relay", "kvcore.policies.session_affinity"]


def test_a_checkout_never_built_runs_from_source(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    for path in root.rglob(f"*{SUFFIX}"):
        path.unlink()
    assert native.built(root) == []
    assert native.stale(root) == []


@functools.cache
def _compiled_trees() -> dict[str, ast.Module]:
    """Each compiled module's source, parsed once for every check below."""
    return {name: ast.parse(native.source(name).read_text()) for name in native.MODULES}


def test_no_compiled_function_binds_one_name_to_two_exception_types() -> None:
    """Compiled, ``except A as exc: ... except B as exc:`` gives ``exc`` A's type, and a
    B becomes a TypeError: a 500 where the proxy meant a 400 (the fuzz test of
    tests/e2e/test_proxy_static.py found one in ``Router._prompt``)."""
    found = []
    for name, tree in _compiled_trees().items():
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
            found += [
                f"{name}.{function.name}: {n}" for n, types in bound.items() if len(types) > 1
            ]
    assert found == []


def _compiled_classes() -> dict[str, ast.ClassDef]:
    """Every class the compiled modules define, by name."""
    return {
        node.name: node
        for tree in _compiled_trees().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def test_no_compiled_class_aliases_a_method() -> None:
    """Compiled, ``select_scored = select`` in a class body left a ``KeyError: 'select'``
    pending, raised later by whatever C code next checked for an error (pydantic's
    ``model_dump`` in the proxy's first keyed request)."""
    found = []
    for cls in _compiled_classes().values():
        methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        found += [
            f"{cls.name}.{ast.unparse(node)}"
            for node in cls.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Name)
            and node.value.id in methods
        ]
    assert found == []


def test_a_class_attribute_a_compiled_subclass_overrides_is_a_classvar() -> None:
    """Compiled methods of a base read the base's value of a plain class attribute, not
    a subclass's: ``KvAwarePolicy``'s decisions were named ``kv``, its base's ``name``,
    until the base declared it ``ClassVar``."""
    classes = _compiled_classes()

    def attributes(cls: ast.ClassDef) -> dict[str, bool]:  # name -> declared ClassVar
        found = {}
        for node in cls.body:
            if isinstance(node, ast.Assign):
                found.update({t.id: False for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found[node.target.id] = "ClassVar" in ast.unparse(node.annotation)
        return found

    overridden = []
    for cls in classes.values():
        for base in cls.bases:
            parent = classes.get(ast.unparse(base))
            if parent is None:
                continue
            inherited = attributes(parent)
            overridden += [
                f"{parent.name}.{name} (overridden by {cls.name})"
                for name in attributes(cls)
                if inherited.get(name) is False
            ]
    assert overridden == []


def test_a_compiled_dataclass_that_writes_its_own_init_takes_its_fields_in_order() -> None:
    """The ``__init__`` a per-request dataclass writes (see the test in
    tests/unit/bench/test_proxy_path.py) must take what ``@dataclass`` would: each init
    field in order with its default (``None`` for a ``default_factory``) and assign
    every field, the derived ones too."""
    checked, found = 0, []
    for cls in _compiled_classes().values():
        if not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
            continue
        init = next(
            (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
        )
        if init is None:
            continue
        checked += 1
        fields = [
            n for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)
        ]  # fmt: skip
        wanted = []
        for node in fields:
            value = ast.unparse(node.value) if node.value is not None else None
            if value is not None and value.startswith("field("):
                if "init=False" in value:
                    continue
                value = "None" if "default_factory" in value else value
            wanted.append((node.target.id, value))  # type: ignore[union-attr]
        params = init.args.args[1:]
        defaults = [None] * (len(params) - len(init.args.defaults)) + init.args.defaults
        taken = [
            (a.arg, ast.unparse(d) if d is not None else None)
            for a, d in zip(params, defaults, strict=True)
        ]
        assigned = {
            t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
        }  # fmt: skip
        missing = {n.target.id for n in fields} - assigned  # type: ignore[union-attr]
        if taken != wanted or missing:
            found.append(f"{cls.name}: takes {taken}, fields {wanted}, unassigned {missing}")
    assert checked >= 14  # the per-request classes: the check looks at something
    assert found == []


_ABCS = {"Sequence", "Mapping", "MutableMapping", "Set", "Iterable", "Collection", "Container"}


def test_nothing_asks_isinstance_of_a_compiled_class_with_an_abc_base() -> None:
    """Compiled, such a class shares its ABC's registry: ``isinstance((), Reasons)`` was
    true, and a decision whose reasons were a tuple broke its debug header; ``type(x) is``
    asks what was meant."""
    abc_based = {
        cls.name
        for cls in _compiled_classes().values()
        if any(ast.unparse(base).split("[")[0].rsplit(".")[-1] in _ABCS for base in cls.bases)
    }
    assert abc_based  # ReplicaBoard and Reasons: the check looks at something
    root = native.source(native.MODULES[0]).parents[1]
    found = []
    for package in ("bench", "controlplane", "dataplane", "enginesim", "kvcore", "kvroute",
                    "sidecar"):  # fmt: skip
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance"
                    and len(node.args) == 2
                    and abc_based
                    & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
