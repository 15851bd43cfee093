"""``kvroute explain`` as a process, against the admin API on real etcd and SQLite: it
prints the replica the control plane's explainer chooses, and why."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from kvcore.keys import block_keys
from kvcore.request import prompt_token_ids
from kvcore.tokenize import load_tokenizer
from kvroute.explain import ask
from tests.integration.controlplane.records.conftest import (
    ADMIN_TOKEN,
    InTestFleet,
    RecordsFactory,
    replica_info,
    serve,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
]
MODEL = "kvroute/sim-model"  # not configured: the explainer keys it as a proxy would
SYSTEM = "You are a careful assistant. " * 40


async def kvroute(*argv: str) -> tuple[int, str, str]:
    """Run the ``kvroute`` command; its exit status, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_ADMIN_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from kvroute.cli import main; sys.exit(main())",
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_kvroute_explain_prints_the_choice_and_each_replicas_figures(
    make_records: RecordsFactory, tmp_path: Path
) -> None:
    fleet = InTestFleet([replica_info("r0"), replica_info("r1", running=3)])
    records = await make_records(fleet)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    tokens = prompt_token_ids({"model": MODEL, "messages": messages}, load_tokenizer("builtin"))
    keys = block_keys(tokens, model=MODEL, block_size=16)
    fleet.hold("r1", keys)
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    async with serve(records.app) as base:
        argv = ["explain", "--admin-url", base, "--model", MODEL, "--system", SYSTEM, "hello"]
        status, out, err = await kvroute(*argv, "--token-file", str(token_file))
        assert status == 0, err
        lines = out.splitlines()
        assert lines[0] == "replica r1 by kv_cost, workload default"
        assert lines[1].endswith(f"{len(tokens)} prompt tokens, {len(keys)} blocks of 16")
        chosen = next(line for line in lines if line.startswith("* "))
        assert chosen.split()[1:3] == ["r1", str(len(keys))]

        status, out, err = await kvroute(*argv)  # no token
        assert (status, out) == (1, "")
        assert err.startswith("kvroute explain: ") and " answered 401: " in err

        answer = await ask(base, ADMIN_TOKEN, {"request": {"model": MODEL, "messages": messages}})
        assert answer["decision"]["replica_id"] == "r1" and answer["blocks"] == len(keys)
