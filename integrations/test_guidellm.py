"""guidellm 0.8's synthetic benchmark against ``kvroute up``, offline, with the command
docs/clients.md shows: the tokenizer folder ``kvroute up`` printed makes prompts of the
length asked for, and the engines count each prompt as guidellm does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from fleet import MODEL, OFFLINE, Fleet

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 512, 32, 6


def guidellm_run(fleet: Fleet, report: Path) -> subprocess.CompletedProcess[str]:
    guidellm = Path(sys.executable).parent / "guidellm"
    argv = [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={fleet.proxy},model={MODEL},"
        "request_format=/v1/completions",
        "--tokenizer", f"kind=huggingface_auto,model={fleet.tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
        f"output_tokens={OUTPUT_TOKENS}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, **OFFLINE}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def prompt_tokens_counted(fleet: Fleet) -> float:
    """The proxy's count of prompt tokens the engines answered (their usage)."""
    text = httpx.get(fleet.proxy + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvroute_proxy_prompt_tokens_total{")
    )


def test_synthetic_prompts_are_the_length_asked_for_on_both_sides(
    fleet: Fleet, tmp_path: Path
) -> None:
    before = prompt_tokens_counted(fleet)
    done = guidellm_run(fleet, tmp_path / "report.json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    served = report["benchmarks"][0]["requests"]["successful"]
    assert len(served) == REQUESTS
    for request in served:
        assert abs(request["prompt_tokens"] - PROMPT_TOKENS) <= PROMPT_TOKENS // 100
        assert request["output_tokens"] == OUTPUT_TOKENS
    engines = prompt_tokens_counted(fleet) - before
    others = {kind: len(found or ()) for kind, found in report["benchmarks"][0]["requests"].items()}
    assert engines == sum(request["prompt_tokens"] for request in served), others
