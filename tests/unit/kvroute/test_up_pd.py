"""``kvroute up --pd P:D``: the sims it starts and their roles, and what it refuses."""

from __future__ import annotations

import pytest

from kvroute.cli import build_parser, up_options


def test_pd_starts_p_prefill_then_d_decode_sims() -> None:
    options = up_options(build_parser().parse_args(["up", "--pd", "2:3"]))
    assert options.replicas == 5 and options.pd == (2, 3)
    assert [options.role(i) for i in range(5)] == ["prefill"] * 2 + ["decode"] * 3


def test_without_pd_no_replica_has_a_role() -> None:
    options = up_options(build_parser().parse_args(["up", "--replicas", "3"]))
    assert options.replicas == 3 and options.role(0) is None


@pytest.mark.parametrize("value", ["2", "0:2", "2:0", "a:b", "2:-1"])
def test_pd_refuses_what_is_not_p_colon_d_with_both_halves(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["up", "--pd", value])
    assert stopped.value.code == 2
    assert "--pd" in capsys.readouterr().err
