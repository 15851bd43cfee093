"""Flags, environment and secrets of ``kvroute-controlplane``."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.main import SettingsError, load_settings, main


def test_defaults_are_the_briefs_ports_and_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings([])
    assert (settings.admin_host, settings.admin_port) == ("127.0.0.1", 8080)
    assert (settings.grpc_host, settings.grpc_port) == ("127.0.0.1", 50051)
    assert settings.lease_ttl_s == 5
    assert settings.served_pools() is None
    assert settings.database_url.get_secret_value().startswith("sqlite+aiosqlite:///")


def test_every_flag_is_also_an_environment_variable_and_the_flag_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVROUTE_POOLS", "a,b")
    monkeypatch.setenv("KVROUTE_ADMIN_PORT", "9000")
    monkeypatch.setenv("KVROUTE_ETCD_ENDPOINTS", "10.0.0.1:2379, 10.0.0.2:2379")
    settings = load_settings(["--admin-port", "9001", "--instance-id", "cp-1"])
    assert settings.served_pools() == ("a", "b")
    assert settings.admin_port == 9001
    assert settings.etcd_endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert settings.instance_id == "cp-1"


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--admin-port", "70000"], "--admin-port"),
        (["--pools", "a.b"], "--pools"),
        (["--shard", "x/y"], "--shard"),
        (["--etcd-endpoints", "nohost"], "--etcd-endpoints"),
        (["--etcd-prefix", "kvroute"], "--etcd-prefix"),
        (["--grpc-tls-cert", "/etc/hostname"], "--grpc-tls-cert"),
        (["--lease-ttl-s", "1"], "--lease-ttl-s"),
        (["--no-such-flag", "1"], "--no-such-flag"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_exit_status_2(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvroute-controlplane: ")
    assert names in err


def test_secrets_are_not_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for secret in ("--nats-password", "--etcd-password", "--admin-token", "--nats-token"):
        with pytest.raises(SettingsError, match="unrecognized"):
            load_settings([secret, "hunter2"])
    with pytest.raises(SettingsError, match="never a flag") as caught:
        load_settings(["--database-url", "postgresql+asyncpg://kv:hunter2@db/kv"])
    assert "hunter2" not in str(caught.value)


def test_secrets_come_from_the_environment_or_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = "postgresql+asyncpg://kv:hunter2@db/kv"
    monkeypatch.setenv("KVROUTE_DATABASE_URL", url)
    monkeypatch.setenv("KVROUTE_NATS_PASSWORD", "n-secret")
    token = tmp_path / "admin-token"
    token.write_text("a-secret\n")
    settings = load_settings(["--admin-token-file", str(token), "--nats-user", "cp"])
    assert settings.secret("database_url") == url
    assert settings.secret("nats_password") == "n-secret"
    assert settings.secret("admin_token") == "a-secret"
    assert "hunter2" not in repr(settings) and "a-secret" not in repr(settings)


def test_a_bad_secret_is_reported_without_its_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVROUTE_ETCD_PASSWORD", "hunter2")
    assert main([]) == 2  # a password without a user
    empty = tmp_path / "empty"
    empty.write_text("")
    assert main(["--admin-token-file", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert "--etcd-user" in err and "is empty" in err
