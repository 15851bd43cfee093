"""docs/configuration.md and docs/admin-api.md are what scripts/gen_docs.py generates from
the code: a setting or route changed without `make docs` fails here, so in `make check`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(gen_docs: ModuleType) -> dict[str, str]:
    return {name: render() for name, render in gen_docs.PAGES.items()}


@pytest.mark.parametrize("name", ["configuration.md", "admin-api.md"])
def test_the_checked_in_page_is_what_the_code_generates(name: str, pages: dict[str, str]) -> None:
    checked_in = (ROOT / "docs" / name).read_text()
    assert checked_in == pages[name], f"docs/{name} is out of date: run `make docs`"


def test_every_setting_of_every_component_is_listed_with_its_variable(
    gen_docs: ModuleType, pages: dict[str, str]
) -> None:
    page = pages["configuration.md"]
    for component in gen_docs.COMPONENTS:
        listed = gen_docs.options(gen_docs.help_text(component))
        assert listed, f"{component.program} --help lists no flag"
        for option in listed:
            assert f"`{option.flags[0]}`" in page, (component.program, option.flags[0])
        if component.settings is not None:
            for name in gen_docs.load(component.settings).model_fields:
                assert f"`KVROUTE_{name.upper()}`" in page, (component.program, name)


def test_a_secret_is_listed_as_environment_only(pages: dict[str, str]) -> None:
    row = next(r for r in pages["configuration.md"].splitlines() if "`KVROUTE_ADMIN_TOKEN`" in r)
    assert row.startswith("| (environment only) |")


def test_every_admin_route_is_documented(gen_docs: ModuleType, pages: dict[str, str]) -> None:
    schema = gen_docs.openapi_schema()
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"### `{method.upper()} {path}`" in pages["admin-api.md"]


def test_a_changed_description_makes_the_page_stale(
    gen_docs: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataplane.settings import ProxySettings

    monkeypatch.setattr(ProxySettings.model_fields["port"], "description", "Another port.")
    assert gen_docs.stale_pages() == ["configuration.md"]
