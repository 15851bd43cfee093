"""What SGLang makes of a client's request id (``rid``), for ``--event-format sglang``.

A client can name its requests to SGLang, and SGLang then answers under that name: the
``id`` of a whole answer and of every chunk is an engine request's ``rid``
(``meta_info["id"]``, see ``sglang_api``). How the name reaches the engine requests
decides what a client sees, and a name still in use is refused, so this module keeps
both. Facts from SGLang 0.5.23 (``python/sglang/srt/``):

- **Where the rid comes from.** The body's ``rid`` (``entrypoints/openai/protocol.py``:
  ``Optional[Union[List[str], str]]`` on ``CompletionRequest`` and
  ``ChatCompletionRequest``; anything else does not validate), passed unchanged to the
  engine request (``serving_completions`` / ``serving_chat``,
  ``_convert_to_internal_request``: ``rid=request.rid``), with no ``cmpl-`` or
  ``chatcmpl-`` prefix (``serving_base._generate_request_id_base`` returns None before
  its prefixing code). A chat request's ``x-override-rid`` header replaces it, whatever
  the body said, but only on a server started with
  ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`` (``entrypoints/request_headers.py``,
  ``apply_header_overrides``, called after the engine request is built; off by default);
  a completion request never reads it (nor ``X-Request-Id``: SGLang reads neither).
- **One prompt, ``n`` at most 1** (``managers/io_struct.py``,
  ``GenerateReqInput._normalize_single_inputs``): the rid as given, or ``uuid4().hex``.
  A list there is kept as a list, checked for duplicates
  (``_validate_rid_uniqueness``: "Duplicate request IDs detected within the request:
  [...]"), and then fails as a dict key (``tokenizer_manager._init_req_state``): a 500,
  "Internal server error: unhashable type: 'list'".
- **A batch of prompts, or ``n > 1``** (``_normalize_rid``): a string ``r`` becomes
  ``r_0``, ``r_1``, ... one per prompt and sample (``num``: the number of prompts, times
  ``n`` unless ``n`` is 1); a list must have one rid per prompt ("The specified rids
  length mismatch with the batch_size for batch processing."), not per sample, and no
  duplicates. With ``n == 1`` each prompt's request is named so. With ``n > 1``
  (``tokenizer_manager._handle_batch_request``) the warm-ups and the samples get new
  ``uuid4().hex`` ids (``regenerate_rid``), so the answer never carries the client's
  name. A batch with ``n < 1`` expands to nothing (``num <= 0``): a list of rids then
  fails at once on ``obj[0]`` ("list index out of range", a 500), before anything below.
- **Names in use** (``tokenizer_manager._init_req_state``, ``rid_to_state``): each rid
  (each ``r_i``) is taken when the request is normalized, before its LoRA and length
  checks, and given back when its engine request finishes or is aborted, or when the
  request fails before reaching the engine; with ``n > 1``, when the warm-ups are done.
  A request naming a rid still taken is refused with "Duplicate request ID detected:
  r", and so is any reuse within one request.
- **Errors**: these ValueErrors are raised by the tokenizer manager, so they are 400s of
  type ``BadRequestError`` (``_handle_non_streaming_request`` / the stream's kick-start
  in ``_handle_streaming_request``), before any 200 for a stream too.

The simulator keeps its engine request ids its own (``uuid4().hex``, unique whatever the
clients send) and carries the names beside them (``Choices.answer_ids``). Not simulated:
the other ``x-override-*`` headers (SGLang's 400 for one of its integer ones that does
not parse), a client's rid equal to one of SGLang's own uuids in flight, and the order
of a completion's tokenization (SGLang tokenizes after the rid checks, the simulator
before).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from enginesim import protocol as p
from enginesim.engine import RequestHandle

OVERRIDE_HEADER = b"x-override-rid"
_MIN_PURGE = 64  # names held before finished ones are first dropped

GivenRid = str | list[str] | None


def body_rid(raw: msgspec.Raw) -> GivenRid:
    """The body's ``rid``, validated as SGLang's request models type it."""
    if raw == p.ABSENT:
        return None
    try:
        return msgspec.json.decode(raw, type=GivenRid)
    except msgspec.ValidationError as exc:
        raise p.field_error(exc, "rid") from None


@dataclass(frozen=True, slots=True)
class Rids:
    """What SGLang makes of one request's rid."""

    held: list[str]  # the names taken while the request runs, in order
    names: list[str] | None  # each engine request's, in choice order; None: uuid hex each


NO_RIDS = Rids([], None)


def plan(given: GivenRid, prompts: int, n: int, *, batch: bool) -> Rids:
    """``GenerateReqInput``'s normalization of ``given`` for ``prompts`` prompts (a
    ``batch`` when the completion's prompt is a list of prompts) and ``n`` samples."""
    if given is None:
        return NO_RIDS
    if not batch and n <= 1:  # ``is_single``
        if isinstance(given, str):
            return Rids([given], [given])
        _check_distinct(given)
        raise p.ApiError("Internal server error: unhashable type: 'list'")
    if isinstance(given, str):
        held = [f"{given}_{i}" for i in range(prompts if n == 1 else prompts * n)]
    elif len(given) != prompts:
        raise p.BadRequest(
            "The specified rids length mismatch with the batch_size for batch processing.",
            sglang_type="BadRequestError",
        )
    else:
        _check_distinct(given)
        held = given
    if n < 1 and held:
        raise p.ApiError("Internal server error: list index out of range")
    return Rids(held, held if n == 1 else None)


def _check_distinct(rids: list[str]) -> None:
    """``_validate_rid_uniqueness``."""
    if len(set(rids)) != len(rids):
        duplicates = [rid for rid, count in Counter(rids).items() if count > 1]
        raise p.BadRequest(
            f"Duplicate request IDs detected within the request: {duplicates}",
            sglang_type="BadRequestError",
        )


class RidsInFlight:
    """SGLang's ``rid_to_state`` as a client can tell it: which client-given names are
    taken. A name is taken from :meth:`reserve` until the engine request that
    :meth:`hold` gave it is done (finished, aborted or failed), or until
    :meth:`release`. Only names a client gave are kept: SGLang's own are uuids.

    Names of finished requests are dropped when the map has grown to twice what was
    left at the last drop, so its size stays within twice the names in use."""

    def __init__(self) -> None:
        self._holders: dict[str, RequestHandle | None] = {}  # None: not yet submitted
        self._purge_at = _MIN_PURGE

    def reserve(self, rids: Sequence[str]) -> None:
        """Take ``rids``, refusing the first one still taken (``_init_req_state``)."""
        for rid in rids:
            if self._taken(rid):
                raise p.BadRequest(
                    f"Duplicate request ID detected: {rid}", sglang_type="BadRequestError"
                )
        if len(self._holders) + len(rids) > self._purge_at:
            self._purge()
        for rid in rids:
            self._holders[rid] = None

    def hold(self, rids: Sequence[str], handles: Sequence[RequestHandle]) -> None:
        """``rids`` stay taken until their engine requests, ``handles``, are done."""
        for rid, handle in zip(rids, handles, strict=True):
            self._holders[rid] = handle

    def release(self, rids: Sequence[str]) -> None:
        """Give back ``rids`` reserved and not held (a request that failed, or the
        warm-ups of ``n > 1`` done)."""
        holders = self._holders
        for rid in rids:
            if rid in holders and holders[rid] is None:
                del holders[rid]

    def _taken(self, rid: str) -> bool:
        if rid not in self._holders:
            return False
        handle = self._holders[rid]
        return handle is None or not handle.done

    def _purge(self) -> None:
        self._holders = {
            rid: handle
            for rid, handle in self._holders.items()
            if handle is None or not handle.done
        }
        self._purge_at = max(_MIN_PURGE, 2 * len(self._holders))
