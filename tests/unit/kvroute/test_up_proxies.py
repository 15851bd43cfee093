"""The proxies ``kvroute up`` starts: debug headers for the demo, none when asked (the
proxy benchmark measures a proxy as deploy/ runs it); open, for local use, and it says so."""

from __future__ import annotations

from pathlib import Path

from kvroute.up import Fleet, LocalFleet, UpOptions, usage_text


def _argv(tmp_path: Path, *, debug_headers: bool = True) -> list[str]:
    options = UpOptions(data_dir=tmp_path, port=9100, debug_headers=debug_headers)
    fleet = LocalFleet(options, say=lambda _: None)
    fleet.fleet.grpc_addresses = ["127.0.0.1:7001", "127.0.0.1:7002"]
    return fleet.proxy_argv(1)


def test_a_fleets_proxies_show_their_decisions_in_headers_by_default(tmp_path: Path) -> None:
    argv = _argv(tmp_path)
    assert argv[argv.index("--port") + 1] == "9101"
    assert argv[argv.index("--controlplane") + 1] == "127.0.0.1:7001,127.0.0.1:7002"
    assert "--debug-headers" in argv


def test_debug_headers_can_be_left_off(tmp_path: Path) -> None:
    assert "--debug-headers" not in _argv(tmp_path, debug_headers=False)


def test_a_local_fleet_is_open_and_says_so_when_it_starts(tmp_path: Path) -> None:
    assert "--no-auth" in _argv(tmp_path)
    text = usage_text(Fleet(run_dir=tmp_path, admin_token="t", proxy_urls=["http://127.0.0.1:1"]))
    assert "127.0.0.1 only and the proxies take requests\nwithout a key" in text
    assert "production overlay requires one (kvroute-proxy --auth)" in text
