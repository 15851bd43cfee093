"""``kvroute explain``'s command line: what it asks the control plane, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import build_parser, main
from kvroute.servers import free_port


def test_a_request_body_from_a_file_is_sent_as_given(tmp_path: Path) -> None:
    from kvroute.explain import explain_request

    body = {"model": "m", "prompt": "Once upon a time"}
    (tmp_path / "body.json").write_text(json.dumps(body))
    argv = ["explain", "--body", str(tmp_path / "body.json"), "--path", "/v1/completions"]
    args = build_parser().parse_args([*argv, "--workload", "rag"])
    sent = explain_request(args, stdin=None)  # type: ignore[arg-type]
    assert sent == {"request": body, "path": "/v1/completions", "workload": "rag"}


def test_without_a_prompt_it_says_what_to_give(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "hello"]) == 2
    assert capsys.readouterr().err == "kvroute explain: give a prompt and --model, or --body\n"


def test_an_unreachable_control_plane_is_exit_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["explain", "--admin-url", url, "--model", "m", "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute explain: {url}/v1/route/explain: ") and err.count("\n") == 1
