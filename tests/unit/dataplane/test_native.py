"""A checkout's compiled request path never hides a newer source (dataplane/native.py)."""

from __future__ import annotations

import os
from pathlib import Path

from dataplane import native


def _checkout(tmp_path: Path) -> Path:
    """A checkout with every listed module's source, each compiled a second after it,
    and a kvcore module they import."""
    package = tmp_path / "dataplane"
    package.mkdir()
    (tmp_path / "kvcore" / "policies").mkdir(parents=True)
    (tmp_path / "kvcore" / "policies" / "view.py").write_text("")
    os.utime(tmp_path / "kvcore" / "policies" / "view.py", (1_000, 1_000))
    suffix = native._EXTENSIONS[0]
    for name in native.MODULES:
        stem = name.split(".")[1]
        (package / f"{stem}.py").write_text("")
        (package / f"{stem}{suffix}").write_bytes(b"")
        os.utime(package / f"{stem}.py", (1_000, 1_000))
        os.utime(package / f"{stem}{suffix}", (1_001, 1_001))
    (package / f"_native__mypyc{suffix}").write_bytes(b"")
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
    os.utime(root / "kvcore" / "policies" / "view.py", (2_000, 2_000))
    assert native.stale(root) == list(native.MODULES)


def test_a_compiled_module_no_longer_listed_is_stale(tmp_path: Path) -> None:
    """Python would still import it instead of its source."""
    root = _checkout(tmp_path)
    (root / "dataplane" / "fleet_state.py").write_text("")
    (root / "dataplane" / f"fleet_state{native._EXTENSIONS[0]}").write_bytes(b"")
    os.utime(root / "dataplane" / "fleet_state.py", (1_000, 1_000))
    assert native.stale(root) == ["dataplane.fleet_state"]


def test_a_checkout_never_built_runs_from_source(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    for path in (root / "dataplane").glob("*.so"):
        path.unlink()
    assert native.built(root) == []
    assert native.stale(root) == []
