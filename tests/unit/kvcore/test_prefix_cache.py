"""The prefix tokenization cache: exactly the tokenizer's output, with the prefix reused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers, processors

from bench.micro.model_files import CORPUS, train_tiny_bpe, write_config
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


@pytest.fixture(scope="module", params=["gpt2", "gpt2-prefix-space", "llama3"])
def hf_tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HFTokenizer:
    directory = tmp_path_factory.mktemp(f"bpe-{request.param}")
    train_tiny_bpe(directory, style=request.param)
    write_config(directory, bos_token="<s>", eos_token="</s>")
    return HFTokenizer(directory)


def _check_same_as_whole(
    tokenizer: Tokenizer, shared: str, tails: list[str], min_gap: int, specials: bool
) -> None:
    cache = PrefixTokenCache(tokenizer, min_gap=min_gap, max_prompts=3)
    for text in [shared + tails[0], *(shared + tail for tail in tails[1:]), shared, *tails]:
        expected = tokenizer.encode(text, add_special_tokens=specials)
        assert cache.encode(text, add_special_tokens=specials) == expected, repr(text)


@settings(max_examples=80, deadline=None)
@given(
    shared=texts,
    tails=st.lists(texts, min_size=1, max_size=3),
    gap=st.integers(1, 12),
    specials=st.booleans(),
)
def test_builtin_cache_is_token_for_token_identical(
    shared: str, tails: list[str], gap: int, specials: bool
) -> None:
    _check_same_as_whole(BuiltinTokenizer(), shared, tails, gap, specials)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shared=texts,
    tails=st.lists(texts, min_size=1, max_size=3),
    gap=st.integers(1, 12),
    specials=st.booleans(),
)
def test_hf_cache_is_token_for_token_identical(
    hf_tokenizer: HFTokenizer, shared: str, tails: list[str], gap: int, specials: bool
) -> None:
    _check_same_as_whole(hf_tokenizer, shared, tails, gap, specials)


def _conversation(turns: int) -> str:
    body = "".join(f"Turn {i}: the user asks about replica {i % 7}.\n" for i in range(turns))
    return "<s><|system|>\nYou route requests.\n" + body


@pytest.mark.parametrize("make", [BuiltinTokenizer, "hf"])
def test_a_growing_conversation_reuses_its_prefix(make: object, hf_model_dir: Path) -> None:
    tokenizer: Tokenizer = (
        BuiltinTokenizer() if make is BuiltinTokenizer else HFTokenizer(hf_model_dir)
    )
    cache = PrefixTokenCache(tokenizer, min_gap=64)
    cache.encode(_conversation(100), add_special_tokens=False)
    longer = _conversation(110)
    assert cache.encode(longer, add_special_tokens=False) == tokenizer.encode(
        longer, add_special_tokens=False
    )
    assert cache.stats.hits == 1
    assert cache.stats.reused_tokens > 0.85 * len(tokenizer.encode(_conversation(100)))


def test_memory_is_bounded_by_max_prompts() -> None:
    cache = PrefixTokenCache(BuiltinTokenizer(), max_prompts=4, min_gap=8)
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
    cache = PrefixTokenCache(tokenizer, min_gap=4)
    text = "the quick fox\njumps over\nthe lazy dog"
    for _ in range(2):
        assert cache.encode(text) == tokenizer.encode(text)
    assert cache.stats.hits == 0


def test_a_pre_tokenizer_that_does_not_cut_at_newlines_is_called_whole(tmp_path: Path) -> None:
    fast = train_tiny_bpe(tmp_path)
    fast.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    fast.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    assert not tokenizer.segmentable
    cache = PrefixTokenCache(tokenizer, min_gap=1)
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
    cache = PrefixTokenCache(tokenizer, min_gap=1)
    for text in ("the fox\njumps", "the fox\nsleeps"):
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
    cache = PrefixTokenCache(tokenizer, min_gap=1)
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
    cache = PrefixTokenCache(tokenizer, min_gap=1)
    for text in ("ab<|im_end|>\ncd", "ab<|im_end|>\ncd ef"):
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert cache.encode(text, add_special_tokens=False) == whole, repr(text)
    assert cache.stats.hits == int(segmentable)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_prompts"):
        PrefixTokenCache(BuiltinTokenizer(), max_prompts=0)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, gap=st.integers(1, 12), at_start=st.booleans(), by_offsets=st.booleans())
def test_segments_encoded_in_one_call_split_as_each_alone(
    hf_tokenizer: HFTokenizer, text: str, gap: int, at_start: bool, by_offsets: bool
) -> None:
    """One encode of all the segments, split where each starts (by the tokens' byte
    lengths, or by their offsets when those are not known), gives each segment's tokens
    as encoding it alone does: what the cache records for each cut point."""
    bounds = [0, *hf_tokenizer.cut_points(text, gap), len(text)]
    segments = [text[a:b] for a, b in itertools.pairwise(bounds)]
    if not at_start:
        segments = segments[1:] or [text]
    lengths = hf_tokenizer._byte_lengths
    if by_offsets:
        hf_tokenizer._byte_lengths = None
    try:
        one_call = hf_tokenizer.encode_segments(segments, at_start=at_start)
    finally:
        hf_tokenizer._byte_lengths = lengths
    alone = hf_tokenizer._encode_each(segments, at_start=at_start)
    assert one_call == alone, repr(segments)


def test_byte_level_vocabularies_split_without_offsets(hf_tokenizer: HFTokenizer) -> None:
    """Mid-text (after the anchor, as the cache encodes), each token spells its bytes."""
    lengths, text = hf_tokenizer._byte_lengths, "the quick fox\njumps 日本\nover"
    assert lengths is not None
    ids = hf_tokenizer.encode("a\n" + text, add_special_tokens=False)
    assert sum(lengths[i] for i in ids[len(hf_tokenizer._anchor_ids) :]) == len(text.encode())
