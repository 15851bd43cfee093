"""Two kvroute-sim processes in vLLM's disaggregated prefill/decode, driven by hand as
vLLM's reference proxy does: the prefill answers with the transfer parameters naming its
blocks, the decode engine reads them once and decodes; a read of parameters that are
unknown, already read or expired fails as vLLM's NIXL connector fails. What a decode
reads and reports is checked against a model of vLLM's rule (``vllm_decode``); SGLang's
pair the same way, with SGLang's (``sglang_decode``: the decode answers its prefill's
cached tokens; its cache holds and publishes nothing unless started with
``--disaggregation-decode-enable-radix-cache``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e
PREFIX = list(range(10_000, 10_800))  # 800 tokens = 50 blocks of 16
MODEL = "sim-model"


@pytest.fixture(scope="module")
def prefill() -> Iterator[SimProcess]:
    with SimProcess("--instant", f"--model={MODEL}", "--kv-lease-s=2") as proc:
        yield proc


@pytest.fixture(scope="module")
def decode() -> Iterator[SimProcess]:
    with SimProcess("--instant", f"--model={MODEL}") as proc:
        yield proc


def prefill_params(prefill: SimProcess, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The prefill request of vLLM's proxy: ``do_remote_decode``, one token, no stream."""
    asked = {**body, "max_tokens": 1, "stream": False}
    asked["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    answer = prefill.post(path_of(body), asked)
    return answer["kv_transfer_params"], answer


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def vllm_decode(prompt_len: int, held_blocks: int, bs: int = 16) -> dict[str, int]:
    """What vLLM 0.33 does with a P/D decode request whose cache holds the first
    ``held_blocks`` full blocks of its prompt, written from its source (a model of the
    rule, independent of the simulator's code):

    - ``get_computed_blocks`` finds the held run, capped at ``prompt - 1`` tokens;
    - NIXL's ``get_num_new_matched_tokens`` (pull scheduler) counts the rest of the prompt
      as the connector's tokens; ``allocate_slots`` gives them new blocks, and the worker's
      ``_read_blocks`` reads that many of the prefill's blocks, its last ones;
    - ``_update_waiting_for_remote_kv`` sets ``num_computed_tokens`` to the blocks' tokens
      bounded by the prompt, less one when that is the whole prompt (the last token is
      computed again); the first scheduling makes it ``num_cached_tokens``."""
    local_blocks = min(held_blocks, (prompt_len - 1) // bs)
    blocks = -(-prompt_len // bs)
    computed = min(blocks * bs, prompt_len)
    return {
        "blocks_read": blocks - local_blocks,
        "cached_tokens": computed - 1 if computed == prompt_len else computed,
        "local_hits": local_blocks * bs,
        "external_hits": prompt_len - local_blocks * bs,
    }


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def decode_counts(decode: SimProcess) -> dict[str, int]:
    """The decode engine's blocks read so far and its two cache-hit counters."""
    local, external = (int(decode.metric(name)) for name in COUNTERS)
    read = decode.call("GET", "/sim/state")[1]["kv_blocks_read"]
    return {"blocks_read": read, "local_hits": local, "external_hits": external}


def decode_with(
    decode: SimProcess, body: dict[str, Any], params: dict[str, Any]
) -> tuple[Any, dict[str, int]]:
    """The decode half by hand: its answer, and what it read, counted and reported."""
    before = decode_counts(decode)
    answer = decode.post(path_of(body), {**body, "kv_transfer_params": params})
    after = decode_counts(decode)
    seen = {key: after[key] - before[key] for key in after}
    return answer, {**seen, "cached_tokens": cached_tokens(answer["usage"])}


def test_prefill_names_its_blocks_and_holds_them_until_the_decode_reads_them(
    prefill: SimProcess, decode: SimProcess
) -> None:
    body = {"model": MODEL, "prompt": [*PREFIX, 1, 2, 3], "max_tokens": 5}
    params, answer = prefill_params(prefill, body)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"][0]) == 51  # 803 tokens: 50 full blocks and one
    assert params["remote_port"] == int(prefill.url.rsplit(":", 1)[1])
    assert params["remote_num_tokens"] == 803 and params["transfer_mode"] == "pull"
    assert answer["usage"]["completion_tokens"] == 1
    assert prefill.call("GET", "/sim/state")[1]["kv_transfers_held"] == 1
    answer, seen = decode_with(decode, body, params)
    assert answer["usage"]["completion_tokens"] == 5
    # an empty decode: every block read, the last prompt token computed again (802)
    assert seen == vllm_decode(803, held_blocks=0)
    assert seen["cached_tokens"] == 802 and seen["blocks_read"] == 51
    assert prefill.call("GET", "/sim/state")[1]["kv_transfers_held"] == 0
    # read once: the same parameters again are refused, as NIXL's second read fails
    status, error = decode.call("POST", "/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 500 and error["error"]["message"] == "Internal server error"


@pytest.mark.parametrize("held_blocks", [20, 30])
def test_a_decode_holding_the_beginning_reads_only_the_rest(
    prefill: SimProcess, decode: SimProcess, held_blocks: int
) -> None:
    start = 12_000 + 500 * held_blocks  # a prompt no other test sends
    prompt = list(range(start, start + 30 * 16 + 5))  # 485 tokens: 30 full blocks and 5
    warm = {"model": MODEL, "prompt": [*prompt[: held_blocks * 16], 1, 2], "max_tokens": 1}
    decode.post("/v1/completions", warm)  # the decode now holds the first held_blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    answer, seen = decode_with(decode, body, prefill_params(prefill, body)[0])
    assert answer["usage"]["completion_tokens"] == 3
    assert seen == vllm_decode(485, held_blocks)
    assert seen["blocks_read"] == 31 - held_blocks and seen["cached_tokens"] == 484


def test_streamed_chat_decode_and_the_prefill_cache_hit(
    prefill: SimProcess, decode: SimProcess
) -> None:
    system = {"role": "system", "content": "You are kvroute's test. " * 60}
    first = {"model": MODEL, "messages": [system, {"role": "user", "content": "one"}]}
    prefill_params(prefill, first)
    second = {"model": MODEL, "messages": [system, {"role": "user", "content": "two"}]}
    params, answer = prefill_params(prefill, second)
    assert cached_tokens(answer["usage"]) >= 16 * (answer["usage"]["prompt_tokens"] // 16 - 1)
    events = decode.stream(
        "/v1/chat/completions",
        {
            **second,
            "max_tokens": 4,
            "stream": True,
            "kv_transfer_params": params,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 4


def test_unknown_parameters_fail_the_stream_as_vllm_does(decode: SimProcess) -> None:
    forged = {
        "do_remote_prefill": True,
        "remote_engine_id": "not-an-engine",
        "remote_request_id": "cmpl-x-0",
        "remote_block_ids": [[1, 2, 3]],
        "remote_host": "127.0.0.1",
        "remote_port": int(decode.url.rsplit(":", 1)[1]),
    }
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
    events = decode.stream("/v1/completions", {**body, "kv_transfer_params": forged})
    assert events[0]["error"]["code"] == 500 and events[-1] == "[DONE]"
    status, _ = decode.call(
        "POST",
        "/v1/completions",
        {**body, "stream": False, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert status == 500


def test_blocks_not_read_within_the_lease_are_freed(
    prefill: SimProcess, decode: SimProcess
) -> None:
    body = {"model": MODEL, "prompt": list(range(30_000, 30_100)), "max_tokens": 2}
    params, _ = prefill_params(prefill, body)
    deadline = time.monotonic() + 10  # the 2 s lease, checked once a second
    while prefill.call("GET", "/sim/state")[1]["kv_transfers_held"]:
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.05)  # polling the state, bounded by the deadline
    status, _ = decode.call("POST", "/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 500


# -- SGLang: the server's mode, bootstrap fields, both halves sent at once ---------------


@pytest.fixture(scope="module")
def sglang_pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    common = ("--instant", f"--model={MODEL}", "--event-format=sglang", "--kv-lease-s=2")
    with (
        SimProcess(*common, "--disaggregation-mode=prefill") as prefill,
        SimProcess(*common, "--disaggregation-mode=decode") as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def radix_decode() -> Iterator[SimProcess]:
    """An SGLang decode server started with its radix cache on."""
    args = ("--instant", f"--model={MODEL}", "--event-format=sglang", "--kv-lease-s=2")
    flags = ("--disaggregation-mode=decode", "--disaggregation-decode-enable-radix-cache")
    with SimProcess(*args, *flags) as proc:
        yield proc


def sglang_decode(
    prompt_len: int, prefill_cached: int, held: int, *, radix: bool, bs: int = 16
) -> dict[str, Any]:
    """What SGLang 0.5.23's decode server does with a P/D request whose prompt's first
    ``held`` tokens (page-aligned) it decoded before. By default
    (``handle_pd_disaggregation`` resolves ``disable_radix_cache``: its tree matches,
    keeps and publishes nothing) it reads every prompt page and answers its prefill's
    cached tokens (``_commit_transfer_to_req``). With
    ``--disaggregation-decode-enable-radix-cache`` it matches its tree, asks the prefill
    only for the pages beyond (``decode_prefix_len``), answers the prefill's count plus
    what its own hit adds beyond it (``max(0, pre_len - already_computed)``) and keeps
    the prompt, which its KV events publish."""
    held = held if radix else 0
    return {
        "blocks_read": -(-prompt_len // bs) - held // bs,
        "cached_tokens": prefill_cached + max(0, held - prefill_cached),
        "keeps_blocks": radix,
    }


def decode_seen(
    prefill: SimProcess, decode: SimProcess, body: dict[str, Any], room: int
) -> tuple[int, dict[str, Any]]:
    """One pair's request: the prefill's cached tokens and what the decode did."""
    read = decode.call("GET", "/sim/state")[1]["kv_blocks_read"]
    (p_status, p_answer), (d_status, d_answer) = both(
        prefill, decode, "/v1/completions", {**body, **bootstrap_of(prefill, room)}
    )
    assert (p_status, d_status) == (200, 200), (p_answer, d_answer)
    state = decode.call("GET", "/sim/state")[1]
    return cached_tokens(p_answer["usage"]), {
        "blocks_read": state["kv_blocks_read"] - read,
        "cached_tokens": cached_tokens(d_answer["usage"]),
        "keeps_blocks": bool(state["cached_block_hashes"]),
    }


def flush(sim: SimProcess) -> None:
    """SGLang's /flush_cache, once no prefill holds blocks for a decode that never came
    (an earlier test leaves one held until its lease ends)."""
    deadline = time.monotonic() + 10
    while sim.call("GET", "/sim/state")[1]["kv_transfers_held"]:
        assert time.monotonic() < deadline, "a held prefill outlived its lease"
        time.sleep(0.05)  # polling the lease's end, bounded by the deadline
    assert sim.call("POST", "/flush_cache")[0] == 200


def bootstrap_of(prefill: SimProcess, room: int) -> dict[str, Any]:
    """The fields SGLang's router adds, from the prefill server's /server_info."""
    info = prefill.call("GET", "/server_info")[1]
    assert info["disaggregation_mode"] == "prefill"
    port = info["disaggregation_bootstrap_port"]
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


def both(prefill: SimProcess, decode: SimProcess, path: str, body: dict[str, Any]) -> list[Any]:
    """The two halves at once, as SGLang's router sends them: (prefill, decode) answers."""
    with ThreadPoolExecutor(2) as pool:
        if body.get("stream"):
            halves = [pool.submit(sim.stream, path, body) for sim in (prefill, decode)]
        else:
            halves = [pool.submit(sim.call, "POST", path, body) for sim in (prefill, decode)]
        return [half.result() for half in halves]


def test_sglang_pair_decodes_what_the_prefill_computed(
    sglang_pair: tuple[SimProcess, SimProcess],
) -> None:
    prefill, decode = sglang_pair
    body = {"model": MODEL, "prompt": [*PREFIX, 4, 5], "max_tokens": 6}
    (p_status, p_answer), (d_status, d_answer) = both(
        prefill, decode, "/v1/completions", {**body, **bootstrap_of(prefill, 7)}
    )
    assert (p_status, d_status) == (200, 200), (p_answer, d_answer)
    assert p_answer["usage"]["completion_tokens"] == 1
    assert d_answer["usage"]["completion_tokens"] == 6
    # the decode answers the cached tokens its prefill found (none: a cold prefill)
    assert d_answer["usage"]["prompt_tokens_details"] is None
    # the second request's prefill finds the shared prefix in the prefill server's cache
    again = {**body, "prompt": [*PREFIX, 6, 7, 8], **bootstrap_of(prefill, 8)}
    read = decode.call("GET", "/sim/state")[1]["kv_blocks_read"]
    (_, p_again), (_, d_again) = both(prefill, decode, "/v1/completions", again)
    assert cached_tokens(p_again["usage"]) == 800
    assert d_again["usage"]["completion_tokens"] == 6
    assert cached_tokens(d_again["usage"]) == 800  # the prefill's, as SGLang's decode answers
    # every block read, although the decode decoded the same prefix before
    assert decode.call("GET", "/sim/state")[1]["kv_blocks_read"] - read == 51


def test_sglang_pair_streams_a_chat_from_decode(
    sglang_pair: tuple[SimProcess, SimProcess],
) -> None:
    prefill, decode = sglang_pair
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 50}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        **bootstrap_of(prefill, 11),
    }
    _, events = both(prefill, decode, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 3


def test_sglang_decode_without_its_prefill_fails_after_the_wait(
    sglang_pair: tuple[SimProcess, SimProcess],
) -> None:
    prefill, decode = sglang_pair
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, **bootstrap_of(prefill, 99)}
    status, answer = decode.call("POST", "/v1/completions", body)  # the prefill never sent
    assert status == 500 and "Decode handshake failed" in answer["message"]
    status, answer = prefill.call("POST", "/v1/completions", {**body, "bootstrap_room": 100})
    assert status == 500 and "transfer failed" in answer["message"]  # no decode came


@pytest.mark.parametrize("radix", [False, True], ids=["default", "decode-radix-cache"])
def test_sglang_decode_cache_follows_sglangs_rule_with_and_without_its_radix_cache(
    sglang_pair: tuple[SimProcess, SimProcess], radix_decode: SimProcess, radix: bool
) -> None:
    prefill, default_decode = sglang_pair
    decode = radix_decode if radix else default_decode
    info = decode.call("GET", "/server_info")[1]
    assert info["disaggregation_decode_enable_radix_cache"] is radix
    assert info["disable_radix_cache"] is not radix  # SGLang's resolved value
    flush(prefill)
    flush(decode)
    prompt = [*PREFIX, 31, 32]  # 802 tokens: 50 whole pages and 2 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    cached, seen = decode_seen(prefill, decode, body, 21)
    assert seen == sglang_decode(802, cached, 0, radix=radix)
    # the same prefix again, the prefill's cache flushed: only a radix decode holds it
    flush(prefill)
    cached, seen = decode_seen(prefill, decode, {**body, "prompt": [*PREFIX, 33, 34, 35]}, 22)
    assert cached == 0
    assert seen == sglang_decode(803, cached, 800, radix=radix)
