"""Flags and KVROUTE_* environment of kvroute-proxy: names are a contract, bad values exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataplane.main import SettingsRefused, build_parser, load_settings, main

CONTRACT_FLAGS = [
    "--host", "--port", "--workers", "--controlplane", "--pools", "--tokenizer",
    "--static-replicas",
]  # fmt: skip
STATIC = ["--static-replicas", "http://127.0.0.1:8100,http://127.0.0.1:8101/"]


def test_every_contract_flag_exists() -> None:
    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(CONTRACT_FLAGS) <= options


def test_defaults_bind_loopback_8000_with_one_worker() -> None:
    s = load_settings(STATIC)
    assert (s.host, s.port, s.workers, s.tokenizer) == ("127.0.0.1", 8000, 1, "builtin")
    assert s.static_replicas == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert s.static and not s.auth and not s.debug_headers


def test_environment_is_read_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CONTROLPLANE", "10.0.0.1:50051, cp-2:50051")
    monkeypatch.setenv("KVROUTE_POOLS", "a,b")
    monkeypatch.setenv("KVROUTE_WORKERS", "4")
    monkeypatch.setenv("KVROUTE_DEBUG_HEADERS", "true")
    s = load_settings(["--workers", "2", "--tenant-header", "X-Tenant"])
    assert s.controlplane == ["10.0.0.1:50051", "cp-2:50051"]
    assert (s.pools, s.workers, s.debug_headers, s.tenant_header) == (
        ["a", "b"],
        2,
        True,
        "x-tenant",
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "give --controlplane"),
        (["--controlplane", "cp:1", *STATIC], "exclude each other"),
        (["--controlplane", "nowhere"], "--controlplane: 'nowhere' is not host:port"),
        (["--static-replicas", "ftp://x"], "is not an http:// or https:// base URL"),
        (["--pools", "a.b", "--controlplane", "cp:1"], "--pools"),
        (["--workers", "0", *STATIC], "--workers"),
        (["--proxy-id", "p" * 126, *STATIC], "--proxy-id"),  # room for a worker's /63
        (["--replica-tls-ca", "/no/such/ca.pem", *STATIC], "--replica-tls-ca"),
        (["--auth", *STATIC], "--auth needs keys from a control plane"),
        (["--static-strategy", "kv_aware", *STATIC], "invalid choice"),
        (["--no-such-flag", *STATIC], "unrecognized arguments"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsRefused, match=needle):
        load_settings(argv)


def test_a_bad_flag_is_one_line_on_stderr_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "seventy", *STATIC]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kvroute-proxy: --port: ")


def test_a_replica_ca_that_is_no_pem_bundle_is_refused_at_start(tmp_path: Path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    with pytest.raises(SettingsRefused, match=r"--replica-tls-ca.*not a PEM CA bundle"):
        load_settings(["--replica-tls-ca", str(junk), *STATIC])


def test_each_worker_reports_under_an_id_of_its_own() -> None:
    named = load_settings(["--proxy-id", "edge-a", "--workers", "3", *STATIC])
    assert [named.for_worker(i).resolved_proxy_id() for i in range(3)] == [
        "edge-a/0",
        "edge-a/1",
        "edge-a/2",
    ]
    assert named.resolved_proxy_id() == "edge-a"  # the parent's own settings unchanged
    unnamed = load_settings(["--workers", "2", *STATIC])
    assert unnamed.for_worker(1).resolved_proxy_id().endswith(f"-{os.getpid()}")


def test_each_worker_takes_a_place_of_its_own_among_the_routers() -> None:
    """A worker is one more router behind a balancer (the kernel's): worker k of proxy
    index i with N workers starts its turn for new prompts at place i * N + k; without
    --proxy-index a static proxy's workers are places 0..N-1 and the proxy itself none,
    and with a control plane none (it numbers every worker's watch: numbered alike in
    each pod of a Deployment, worker k of every pod would start at the same replica)."""
    placed = load_settings(["--proxy-index", "3", "--workers", "2", *STATIC])
    assert [placed.for_worker(k).proxy_index for k in range(2)] == [6, 7]
    unplaced = load_settings(["--workers", "2", *STATIC])
    assert unplaced.proxy_index is None
    assert [unplaced.for_worker(k).proxy_index for k in range(2)] == [0, 1]
    watching = load_settings(["--workers", "2", "--controlplane", "cp:50051"])
    assert [watching.for_worker(k).proxy_index for k in range(2)] == [None, None]
    with pytest.raises(SettingsRefused, match=r"--proxy-index"):
        load_settings(["--proxy-index", "-1", *STATIC])
