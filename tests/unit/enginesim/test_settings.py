"""Flags and KVROUTE_* environment variables of kvroute-sim (names are a contract)."""

from __future__ import annotations

import pytest

from enginesim.errors import SettingsError
from enginesim.settings import parse_settings

CONTRACT_FLAGS = [
    "--host", "--port", "--model", "--block-size", "--num-blocks", "--max-num-seqs",
    "--max-model-len", "--kv-events-endpoint", "--replay-endpoint", "--topic",
    "--event-format", "--tokenizer", "--time-scale", "--instant",
]  # fmt: skip


def test_defaults_bind_loopback_on_the_documented_ports() -> None:
    s = parse_settings([])
    assert (s.host, s.port) == ("127.0.0.1", 8100)
    assert s.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert s.replay_endpoint == "tcp://127.0.0.1:5558"
    assert (s.event_format, s.tokenizer, s.block_size, s.instant) == ("vllm", "builtin", 16, False)
    assert s.model_len == 32768


def test_every_contract_flag_exists() -> None:
    from enginesim.settings import build_parser

    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(CONTRACT_FLAGS) <= options


def test_environment_is_read_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVROUTE_EVENT_FORMAT", "sglang")
    monkeypatch.setenv("KVROUTE_INSTANT", "true")
    s = parse_settings(["--event-format", "vllm-0.23"])
    assert (s.block_size, s.event_format, s.instant) == (32, "vllm-0.23", True)


def test_model_len_defaults_to_what_the_pool_holds() -> None:
    assert parse_settings(["--num-blocks", "10"]).model_len == 160


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--num-blocks", "10", "--max-model-len", "161"], "exceeds the KV pool"),
        (["--block-size", "0"], "block_size"),
        (["--time-scale", "-1"], "time_scale"),
        (["--request-header-overrides"], "needs event_format sglang"),
        (["--disaggregation-decode-enable-radix-cache"], "is SGLang.s: it needs event_format"),
        (["--ssl-certfile", __file__], "ssl_keyfile and ssl_certfile go together"),
        (["--ssl-keyfile", "/no/such/key.pem", "--ssl-certfile", __file__], "ssl_keyfile"),
    ],
)
def test_invalid_settings_are_refused_with_the_reason(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        parse_settings(argv)


def test_unknown_event_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--event-format", "trtllm"])
    assert exit_info.value.code == 2
    assert "{vllm,vllm-0.23,sglang}" in capsys.readouterr().err
