"""``kvroute up`` for the client-integration suite, as a user runs it: the fleet's
own command, its banner read for the proxy's address and the model's tokenizer folder.

Everything runs with no network: the clients are told so the way a user offline tells
them (``HF_HUB_OFFLINE``, ``LITELLM_LOCAL_MODEL_COST_MAP``), and every request goes to
127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
os.environ.update(OFFLINE)  # before litellm is imported by a test module
MODEL = "kvroute/sim-model"


@dataclass(frozen=True)
class Fleet:
    proxy: str  # http://127.0.0.1:PORT
    tokenizer: Path  # the folder kvroute up printed beside the model

    @property
    def base_url(self) -> str:
        return self.proxy + "/v1"


def read_until(proc: subprocess.Popen[str], needle: str) -> str:
    """kvroute up's output up to the line holding ``needle`` (it prints that line once
    every part is ready; its own deadlines bound the wait)."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return "".join(lines)
    raise AssertionError("kvroute up ended before it was up:\n" + "".join(lines))
