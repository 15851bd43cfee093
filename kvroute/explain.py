"""``kvroute explain``: how a proxy would route a request, and why.

The control plane's admin API answers ``POST /v1/route/explain`` by running the
workload's own policy over its live residency map and load (the explainer in
``controlplane/records/services/explain.py``), so the answer is what a proxy holding the
same state would decide. This command builds that request from a prompt (or a whole
request body), sends it with the admin token from ``KVROUTE_ADMIN_TOKEN`` or a file, and
prints the choice and each replica's figures; ``--json`` prints the API's answer as is.
Exit status: 0 answered, 1 the control plane refused or could not be reached, 2 a
problem with the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import aiohttp

EXPLAIN_PATH = "/v1/route/explain"
DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"  # kvroute-controlplane's --admin-port default
TOKEN_ENV = "KVROUTE_ADMIN_TOKEN"


class ExplainFailed(RuntimeError):
    """The control plane refused the request or did not answer (exit status 1)."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    explain = commands.add_parser(
        "explain",
        help="how a proxy would route a request, and why (the control plane's explainer)",
        description="Ask the control plane's admin API how a proxy would route a request "
        f"and why. The admin token comes from {TOKEN_ENV} or --token-file.",
    )
    explain.add_argument("prompt", nargs="?", help="a user message ('-': read standard input)")
    explain.add_argument("--model", help="the model the request names")
    explain.add_argument("--system", help="a system message before the prompt")
    explain.add_argument(
        "--body", type=Path, help="a whole request body as JSON instead of a prompt ('-': stdin)"
    )
    explain.add_argument(
        "--path", default="/v1/chat/completions", help="the path it would be POSTed to"
    )
    explain.add_argument("--workload", help="as the x-kvroute-workload header")
    explain.add_argument("--tenant", help="the client key's tenant")
    explain.add_argument(
        "--admin-url",
        default=os.environ.get("KVROUTE_ADMIN_URL", DEFAULT_ADMIN_URL),
        help=f"the control plane's admin API (env KVROUTE_ADMIN_URL; {DEFAULT_ADMIN_URL})",
    )
    explain.add_argument("--token-file", type=Path, help="a file holding the admin token")
    explain.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def run(args: argparse.Namespace) -> int:
    """``kvroute explain`` with its parsed arguments; the exit status."""
    try:
        body = explain_request(args, sys.stdin)
        token = admin_token(args.token_file)
    except (ValueError, OSError) as exc:
        print(f"kvroute explain: {exc}", file=sys.stderr)
        return 2
    try:
        answer = asyncio.run(ask(args.admin_url, token, body))
    except ExplainFailed as exc:
        print(f"kvroute explain: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else render(answer))
    return 0


def explain_request(args: argparse.Namespace, stdin: TextIO) -> dict[str, Any]:
    """The body of ``POST /v1/route/explain`` the command line asks for (``ValueError``:
    what is missing or wrong)."""
    if args.body is not None:
        text = stdin.read() if str(args.body) == "-" else args.body.read_text()
        request = json.loads(text)
        if not isinstance(request, dict):
            raise ValueError("--body must hold a JSON object")
    elif args.prompt is None or args.model is None:
        raise ValueError("give a prompt and --model, or --body")
    else:
        prompt = stdin.read() if args.prompt == "-" else args.prompt
        system = [{"role": "system", "content": args.system}] if args.system else []
        request = {"model": args.model, "messages": [*system, {"role": "user", "content": prompt}]}
    body: dict[str, Any] = {"request": request, "path": args.path}
    if args.workload is not None:
        body["workload"] = args.workload
    if args.tenant is not None:
        body["tenant"] = args.tenant
    return body


def admin_token(token_file: Path | None) -> str | None:
    if token_file is not None:
        return token_file.read_text().strip()
    return os.environ.get(TOKEN_ENV)


async def ask(admin_url: str, token: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The control plane's explanation of ``body``; :class:`ExplainFailed` otherwise."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    url = admin_url.rstrip("/") + EXPLAIN_PATH
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.post(url, json=body, headers=headers) as reply,
        ):
            answer = await reply.json(content_type=None)
            if reply.status != 200:
                raise ExplainFailed(f"{url} answered {reply.status}: {_detail(answer)}")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ExplainFailed(f"{url}: {exc or type(exc).__name__}") from None
    if not isinstance(answer, dict):
        raise ExplainFailed(f"{url} answered {answer!r}")
    return answer


def render(answer: dict[str, Any]) -> str:
    """The explanation as a reader wants it: the choice, then one row per replica."""
    decision = answer["decision"]
    lines = [
        f"replica {decision.get('replica_id') or '(none)'} by {decision['strategy']}, "
        f"workload {answer['workload']}",
        f"model {answer['model']} in pool {answer['pool']}: {answer['prompt_tokens']} prompt "
        f"tokens, {answer['blocks']} blocks of {answer['block_size']}",
    ]
    for note in (decision.get("note"), answer.get("note")):
        if note:
            lines.append(f"note: {note}")
    lines.append(f"  {'replica':<24} {'hit blocks':>10} {'hit':>7} {'load':>7} {'score':>10}")
    for row in decision["replicas"]:
        chosen = "*" if row["replica_id"] == decision.get("replica_id") else " "
        excluded = f"  excluded: {row['excluded']}" if row.get("excluded") else ""
        lines.append(
            f"{chosen} {row['replica_id']:<24} {row.get('hit_blocks', 0):>10} "
            f"{_figure(row.get('hit')):>7} {_figure(row.get('load')):>7} "
            f"{_figure(row.get('score')):>10}{excluded}"
        )
    return "\n".join(lines)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _detail(answer: Any) -> str:
    if isinstance(answer, dict) and "detail" in answer:
        return json.dumps(answer["detail"])
    return json.dumps(answer)
