"""The prefix cache: exactly the tokenizer's tokens and the uncached block keys, with the
prefix reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers, processors

from bench.micro.model_files import CORPUS, train_tiny_bpe, write_config
from enginesim.sim_model import SIM_MODEL_DIR
from kvcore.keys import chain_keys, root_key
from kvcore.request import prompt_keys, prompt_token_ids
from kvcore.tokenize import (
    BuiltinTokenizer,
    HFTokenizer,
    PrefixTokenCache,
    SegmentableTokenizer,
    Tokenizer,
)

FRAGMENTS = [
    "the",
    " quick",
    " fox",
    "\n",
    "\n\n",
    "  ",
    "\t",
    ".",
    ",",
    "'s",
    "!?",
    "12345",
    " 678",
    "über",
    " café",
    "日本",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|user|>",
    "<|end|>",
    "a\n",
    "x\nY",
    " \n ",
    "\r\n",
    "def f():\n    return 1\n",
]
ALPHABET = "ab yz.,'!?0123\n\t\r-éü日"
texts = st.lists(
    st.sampled_from(FRAGMENTS) | st.text(alphabet=ALPHABET, max_size=6), max_size=24
).map("".join)


@pytest.fixture(scope="module", params=["gpt2", "gpt2-prefix-space", "llama3", "sim-model"])
def hf_tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HFTokenizer:
    if request.param == "sim-model":  # the simulated model's shipped folder
        return HFTokenizer(SIM_MODEL_DIR)
    directory = tmp_path_factory.mktemp(f"bpe-{request.param}")
    train_tiny_bpe(directory, style=request.param)
    write_config(directory, bos_token="<s>", eos_token="</s>")
    return HFTokenizer(directory)


@pytest.fixture(scope="module")
def chatml(hf_model_dir: Path) -> HFTokenizer:
    return HFTokenizer(hf_model_dir)


def _check_same_as_whole(
    tokenizer: Tokenizer, shared: str, tails: list[str], chunk: int, specials: bool
) -> None:
    cache = PrefixTokenCache(tokenizer, chunk=chunk, max_prompts=3)
    for text in [shared + tails[0], *(shared + tail for tail in tails[1:]), shared, *tails]:
        expected = tokenizer.encode(text, add_special_tokens=specials)
        assert cache.encode(text, add_special_tokens=specials) == expected, repr(text)


@settings(max_examples=80, deadline=None)
@given(
    shared=texts,
    tails=st.lists(texts, min_size=1, max_size=3),
    chunk=st.integers(1, 12),
    specials=st.booleans(),
)
def test_builtin_cache_is_token_for_token_identical(
    shared: str, tails: list[str], chunk: int, specials: bool
) -> None:
    _check_same_as_whole(BuiltinTokenizer(), shared, tails, chunk, specials)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shared=texts,
    tails=st.lists(texts, min_size=1, max_size=3),
    chunk=st.integers(1, 12),
    specials=st.booleans(),
)
def test_hf_cache_is_token_for_token_identical(
    hf_tokenizer: HFTokenizer, shared: str, tails: list[str], chunk: int, specials: bool
) -> None:
    _check_same_as_whole(hf_tokenizer, shared, tails, chunk, specials)


@pytest.mark.parametrize("make", [BuiltinTokenizer, "hf"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    first=texts,
    steps=st.lists(st.tuples(st.integers(0, 10), texts), min_size=1, max_size=6),
    chunk=st.integers(1, 12),
)
def test_branching_conversations_are_token_and_key_identical(
    make: object, chatml: HFTokenizer, first: str, steps: list[tuple[int, str]], chunk: int
) -> None:
    """Each prompt extends an earlier one (a conversation that goes on, or branches off
    an older turn), so prompts resume inside tails that other prompts share."""
    tokenizer: Tokenizer = BuiltinTokenizer() if make is BuiltinTokenizer else chatml
    cache = PrefixTokenCache(tokenizer, chunk=chunk, max_prompts=4)
    root = root_key(model="m")
    prompts = [first]
    for parent, more in steps:
        prompts.append(prompts[parent % len(prompts)] + "\n" + more)
    for text in [*prompts, *reversed(prompts)]:
        got = cache.encode_keyed(text, add_special_tokens=False, root=root, block_size=2)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert got.token_list() == tokens, repr(text)
        assert got.keys == chain_keys(root, tokens, 2), repr(text)


def _conversation(turns: int) -> str:
    body = "".join(f"Turn {i}: the user asks about replica {i % 7}.\n" for i in range(turns))
    return "<s><|system|>\nYou route requests.\n" + body


@pytest.mark.parametrize("make", [BuiltinTokenizer, "hf"])
def test_a_growing_conversation_reuses_its_prefix(make: object, hf_model_dir: Path) -> None:
    tokenizer: Tokenizer = (
        BuiltinTokenizer() if make is BuiltinTokenizer else HFTokenizer(hf_model_dir)
    )
    cache = PrefixTokenCache(tokenizer, chunk=64)
    cache.encode(_conversation(100), add_special_tokens=False)
    longer = _conversation(110)
    assert cache.encode(longer, add_special_tokens=False) == tokenizer.encode(
        longer, add_special_tokens=False
    )
    assert cache.stats.hits == 1
    assert cache.stats.reused_tokens > 0.85 * len(tokenizer.encode(_conversation(100)))


def test_memory_is_bounded_by_max_prompts() -> None:
    cache = PrefixTokenCache(BuiltinTokenizer(), max_prompts=4, chunk=8)
    for i in range(20):
        cache.encode(f"prompt{i:04d} with some words in it")
    assert len(cache) == 4
    cache.encode("prompt0000 with some words in it and more")
    assert cache.stats.hits == 0  # the first prompts were forgotten
    cache.encode("prompt0019 with some words in it and more")
    assert cache.stats.hits == 1


def test_tokenizers_that_cannot_be_cut_are_called_whole(tmp_path: Path) -> None:
    train_tiny_bpe(tmp_path, style="metaspace")
    tokenizer = HFTokenizer(tmp_path)
    assert not tokenizer.segmentable and isinstance(tokenizer, SegmentableTokenizer)
    cache = PrefixTokenCache(tokenizer, chunk=4)
    text = "the quick fox\njumps over\nthe lazy dog"
    for _ in range(2):
        assert cache.encode(text) == tokenizer.encode(text)
    assert cache.stats.hits == 0


def test_a_tokenizer_that_cannot_be_cut_still_reuses_the_keys_of_equal_tokens(
    tmp_path: Path,
) -> None:
    """Encoded whole each time, but the blocks whose tokens equal the last prompt's keep
    their keys: they are the uncached keys, and only the new blocks are hashed."""
    train_tiny_bpe(tmp_path, style="metaspace")
    tokenizer, root = HFTokenizer(tmp_path), root_key(model="m")
    cache = PrefixTokenCache(tokenizer, chunk=16)
    shared = "".join(f"the quick fox {i} jumps over the lazy dog\n" for i in range(40))
    for tail in ("unicode café", "numbers 12345", "punctuation!?"):
        got = cache.encode_keyed(shared + tail, add_special_tokens=False, root=root, block_size=4)
        tokens = tokenizer.encode(shared + tail, add_special_tokens=False)
        assert got.tokens.tolist() == tokens
        assert got.keys == chain_keys(root, tokens, 4)
    assert cache.stats.hits == 0  # no tokens reused
    assert cache.stats.reused_keys > 1.5 * cache.stats.hashed_keys  # most keys were


def test_a_pre_tokenizer_that_does_not_cut_at_newlines_is_called_whole(tmp_path: Path) -> None:
    fast = train_tiny_bpe(tmp_path)
    fast.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    fast.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    assert not tokenizer.segmentable
    cache = PrefixTokenCache(tokenizer, chunk=1)
    for text in ("ab\ncd ef\ngh", "ab\ncd ef\nij"):
        assert cache.encode(text) == tokenizer.encode(text)
    assert cache.stats.hits == 0


def test_special_tokens_from_a_post_processor_wrap_the_cached_tokens(tmp_path: Path) -> None:
    fast = train_tiny_bpe(tmp_path)
    bos, eos = fast.token_to_id("<s>"), fast.token_to_id("</s>")
    fast.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    fast.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    cache = PrefixTokenCache(tokenizer, chunk=1)
    for text in ("the fox\njumps over", "the fox\njumps under"):
        ids = cache.encode(text)
        assert ids == tokenizer.encode(text)
        assert ids[0] == bos and ids[-1] == eos
    assert cache.stats.hits == 1


def test_added_tokens_that_strip_whitespace_before_them_stay_exact(tmp_path: Path) -> None:
    fast = train_tiny_bpe(tmp_path)
    from tokenizers import AddedToken

    fast.add_special_tokens([AddedToken("<|eot|>", lstrip=True)])
    fast.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    cache = PrefixTokenCache(tokenizer, chunk=1)
    first, second = "abc\n<|eot|>the fox", "abc\n<|eot|>the dog\nx"
    for text in (first, second):
        assert cache.encode(text, add_special_tokens=False) == tokenizer.encode(
            text, add_special_tokens=False
        )


@pytest.mark.parametrize(("style", "segmentable"), [("gpt2-prefix-space", False), ("gpt2", True)])
def test_a_prefix_space_per_piece_after_an_added_token_is_not_cut(
    tmp_path: Path, style: str, segmentable: bool
) -> None:
    """ByteLevel with add_prefix_space adds a space to each piece between added tokens:
    ``<|im_end|>\ncd`` reads `` \ncd`` whole, but a cut after the newline leaves a head
    ending in `` \n``, which this vocabulary merges into one token."""
    fast = train_tiny_bpe(tmp_path, style=style, corpus=[*CORPUS, *["end \nnext \nmore \n"] * 20])
    assert fast.token_to_id("\u0120\u010a") is not None  # the merge of " \n"
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.segmentable is segmentable
    cache = PrefixTokenCache(tokenizer, chunk=1)
    for text in ("ab<|im_end|>\ncd", "ab<|im_end|>\ncd ef"):
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert cache.encode(text, add_special_tokens=False) == whole, repr(text)
    assert cache.stats.hits == int(segmentable)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_prompts"):
        PrefixTokenCache(BuiltinTokenizer(), max_prompts=0)
    with pytest.raises(ValueError, match="chunk"):
        PrefixTokenCache(BuiltinTokenizer(), chunk=0)


def _cuts(tokenizer: SegmentableTokenizer, text: str) -> set[int]:
    return {tokenizer.last_cut(text, shared) for shared in range(len(text) + 1)} - {0}


@pytest.mark.parametrize("make", [BuiltinTokenizer, "hf"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, by_offsets=st.booleans())
def test_tokens_resumed_at_a_cut_are_the_whole_texts_from_there(
    make: object, chatml: HFTokenizer, text: str, by_offsets: bool
) -> None:
    """The cut-point contract the cache rests on: encoding from a cut gives the whole
    text's tokens from the one that starts there, and ``starts`` says which one that is
    (by the tokens' byte lengths, or by their offsets when those are not known)."""
    tokenizer: BuiltinTokenizer | HFTokenizer = BuiltinTokenizer()
    if make == "hf":
        tokenizer = HFTokenizer(chatml.directory) if by_offsets else chatml
    if by_offsets and isinstance(tokenizer, HFTokenizer):
        tokenizer._byte_lengths = None
    ids = tokenizer.encode_from(text, 0)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    starts = tokenizer.token_starts(text, 0, ids)  # UTF-8 byte offsets
    assert starts is not None and len(starts) == len(ids)
    for cut in _cuts(tokenizer, text):
        at = len(text[:cut].encode("utf-8", "surrogatepass"))
        assert at in starts, (text, cut)
        index = starts.index(at)
        assert tokenizer.encode_from(text, cut) == ids[index:], (text, cut)
        assert tokenizer.token_starts(text, cut, ids[index:]) == starts[index:], (text, cut)


def _newline_cuts_reference(text: str, end: int) -> int:
    """The HF rule, spelled out: the last offset before ``end`` right after a newline
    that follows a non-space and precedes one."""
    found = [
        p
        for p in range(2, end)
        if text[p - 1] == "\n" and not text[p - 2].isspace() and not text[p].isspace()
    ]
    return max(found, default=0)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, blank_lines=st.integers(0, 40), tail=texts)
def test_hf_last_cut_is_the_last_newline_between_non_spaces(
    chatml: HFTokenizer, text: str, blank_lines: int, tail: str
) -> None:
    """Found from the last few newlines, or by the regex when more than a few blank or
    indented lines come after the last cut."""
    assert not chatml._lstrip_tokens  # no added token moves a cut
    text = text + "\n \n" * blank_lines + tail
    for shared in range(len(text) + 1):
        assert chatml.last_cut(text, shared) == _newline_cuts_reference(text, shared), shared


@settings(max_examples=40, deadline=None)
@given(head=texts, tails=st.lists(texts, min_size=2, max_size=2))
def test_a_cut_is_decided_by_the_shared_text_alone(head: str, tails: list[str]) -> None:
    """A cut found in what two texts share is a cut of both."""
    tokenizer = BuiltinTokenizer()
    first, second = (head + tail for tail in tails)
    cut = tokenizer.last_cut(first, len(head))
    assert cut == tokenizer.last_cut(second, len(head))
    assert cut == 0 or cut in _cuts(tokenizer, first) & _cuts(tokenizer, second)


def test_byte_level_vocabularies_split_without_offsets(hf_tokenizer: HFTokenizer) -> None:
    """Mid-text (after the anchor, as the cache encodes), each token spells its bytes."""
    lengths, text = hf_tokenizer._byte_lengths, "the quick fox\njumps 日本\nover"
    assert lengths is not None
    ids = hf_tokenizer.encode("a\n" + text, add_special_tokens=False)
    assert sum(lengths[i] for i in ids[len(hf_tokenizer._anchor_ids) :]) == len(text.encode())


ROLES = ["system", "user", "assistant"]
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts}),
    min_size=1,
    max_size=5,
)
edits = st.lists(
    st.tuples(
        st.sampled_from(["extend", "edit", "same"]),
        messages,
        st.integers(0, 4),  # which message an edit replaces
        st.sampled_from(["", "tenant-a", "tenant-b"]),  # cache_salt: the keys' namespace
        st.sampled_from(["model-1", "model-2"]),
        st.sampled_from([1, 4, 16]),
    ),
    min_size=1,
    max_size=5,
)


def _next_conversation(
    conversation: list[dict[str, str]], op: str, new: list[dict[str, str]], at: int
) -> list[dict[str, str]]:
    if op == "extend":
        return conversation + new
    if op == "edit":
        at = min(at, len(conversation) - 1)
        return [*conversation[:at], new[0], *conversation[at + 1 :]]
    return conversation


def _check_keyed_conversation(
    tokenizer: Tokenizer, first: list[dict[str, str]], steps: list[tuple[Any, ...]], chunk: int
) -> None:
    """Every request of a conversation that grows, is edited in the middle, or repeats,
    under changing tenants, models and block sizes: the cache's tokens and keys are the
    uncached render + tokenize + key's."""
    cache = PrefixTokenCache(tokenizer, chunk=chunk, max_prompts=4)
    conversation = first
    for op, new, at, salt, model, block_size in steps:
        conversation = _next_conversation(conversation, op, new, at)
        body = {"model": model, "messages": conversation}
        root = root_key(model=model, namespace=salt)
        got = prompt_keys(body, cache, root=root, block_size=block_size)
        tokens = prompt_token_ids(body, tokenizer)
        assert got.tokens.tolist() == tokens
        assert got.keys == chain_keys(root, tokens, block_size)


@settings(max_examples=60, deadline=None)
@given(first=messages, steps=edits, chunk=st.integers(4, 64))
def test_builtin_keys_through_the_cache_are_the_uncached_keys(
    first: list[dict[str, str]], steps: list[tuple[Any, ...]], chunk: int
) -> None:
    _check_keyed_conversation(BuiltinTokenizer(), first, steps, chunk)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(first=messages, steps=edits, chunk=st.integers(4, 64))
def test_hf_keys_through_the_cache_are_the_uncached_keys(
    chatml: HFTokenizer, first: list[dict[str, str]], steps: list[tuple[Any, ...]], chunk: int
) -> None:
    _check_keyed_conversation(chatml, first, steps, chunk)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(texts, min_size=1, max_size=4),
    shared=texts,
    block_size=st.sampled_from([1, 2, 16]),
)
def test_completion_keys_count_the_special_tokens(
    prompts: list[str], shared: str, block_size: int
) -> None:
    """A completion's text is encoded with BOS in front: its keys include it, cached
    or not, and never reuse a chat's keys for the same text (which has no BOS)."""
    tokenizer, root = BuiltinTokenizer(), root_key(model="m")
    cache = PrefixTokenCache(tokenizer, chunk=4)
    for prompt in prompts:
        for body in ({"prompt": shared + prompt}, {"prompt": [shared + prompt, "x"]}):
            got = prompt_keys(body, cache, root=root, block_size=block_size)
            tokens = tokenizer.encode(shared + prompt)
            assert got.tokens.tolist() == tokens
            assert got.keys == chain_keys(root, tokens, block_size)
        text = cache.encode_keyed(shared + prompt, add_special_tokens=False, root=root)
        assert text.keys == chain_keys(
            root, tokenizer.encode(shared + prompt, add_special_tokens=False), 16
        )


def test_a_prompt_extending_a_remembered_one_tokenizes_and_hashes_only_its_tail() -> None:
    tokenizer, root = BuiltinTokenizer(), root_key(model="m")
    cache = PrefixTokenCache(tokenizer)
    system = [{"role": "system", "content": _conversation(400)}]
    first = cache.encode_keyed(
        tokenizer.apply_chat_template(system), add_special_tokens=False, root=root
    )
    question = [*system, {"role": "user", "content": "Which replica holds turn 12?"}]
    second = cache.encode_keyed(
        tokenizer.apply_chat_template(question), add_special_tokens=False, root=root
    )
    assert second.keys[: len(first.keys) - 1] == first.keys[:-1]
    assert cache.stats.hits == 1
    assert cache.stats.encoded_tokens - len(first.tokens) < 20  # the question and markup
    assert cache.stats.hashed_keys - len(first.keys) <= 2


def test_interleaved_conversations_each_extend_their_own() -> None:
    """Two chats sharing a system prompt take turns: each request reuses its own chat's
    last prompt, not merely the system prompt the other chat's (newer) prompt shares."""
    tokenizer = BuiltinTokenizer()
    cache = PrefixTokenCache(tokenizer, chunk=64)
    system = {"role": "system", "content": _conversation(50)}
    chats: dict[str, list[dict[str, str]]] = {"a": [system], "b": [system]}
    for turn in range(4):
        for name, chat in chats.items():
            chat.append({"role": "user", "content": f"{name} asks {turn}:" + " more" * 100})
            text = tokenizer.apply_chat_template(chat)
            before = cache.stats.encoded_tokens
            whole = tokenizer.encode(text, add_special_tokens=False)
            assert cache.encode(text, add_special_tokens=False) == whole
            if turn:
                assert cache.stats.encoded_tokens - before < 120  # the new message alone


@pytest.mark.parametrize("make", [BuiltinTokenizer, "hf"])
def test_a_conversation_in_other_scripts_reuses_its_prefix(
    make: object, chatml: HFTokenizer
) -> None:
    """Offsets are kept in UTF-8 bytes, so a non-ASCII prompt resumes where it left off."""
    tokenizer = BuiltinTokenizer() if make is BuiltinTokenizer else chatml
    cache = PrefixTokenCache(tokenizer, chunk=64)
    turns = [f"Größe {i}: 日本語のテキスト über café.\n" for i in range(80)]
    for count in (40, 60, 80):
        text = "".join(turns[:count])
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert cache.encode(text, add_special_tokens=False) == whole
    assert cache.stats.hits == 2
    assert cache.stats.encoded_tokens < 1.25 * len(whole)  # not 40 + 60 + 80 turns' worth
