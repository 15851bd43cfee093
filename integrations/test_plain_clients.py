"""curl and httpx against ``kvroute up``, with the commands docs/clients.md shows."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from fleet import MODEL, Fleet


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on PATH")
def test_curl_chat_completion(fleet: Fleet) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    command = ["curl", "-s", f"{fleet.base_url}/chat/completions",
               "-H", "content-type: application/json", "-d", json.dumps(body)]  # fmt: skip
    answer = json.loads(subprocess.run(command, capture_output=True, check=True, timeout=30).stdout)
    assert len(answer["choices"][0]["message"]["content"].split()) == 4
    assert answer["usage"]["completion_tokens"] == 4


def test_httpx_streams_events_and_the_usage_asked_for(fleet: Fleet) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Stream, please"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{fleet.base_url}/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text.split()) == 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
