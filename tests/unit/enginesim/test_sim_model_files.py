"""The simulated model's Hugging Face folder (``enginesim/models/sim-model``): what a
benchmark client loads from it is what the simulator runs.

A client counts a prompt's tokens with ``tokenizers.Tokenizer.from_file`` or
``transformers.AutoTokenizer.from_pretrained`` (guidellm, ``vllm bench serve``); the
simulator started with ``--tokenizer`` on the folder encodes prompts and renders chats
with kvcore's loader. Over random text and conversations both give the same ids, and the
chat template renders what the built-in tokenizer's does. The ``transformers`` checks
run where it is installed (it is not a dependency of kvroute).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from enginesim.sim_model import MAX_POSITION_EMBEDDINGS, SIM_MODEL_DIR
from enginesim.tokens import FILLER_WORDS, PromptTokenizer
from kvcore.tokenize import BuiltinTokenizer
from kvcore.tokenize.builtin import SPECIAL_TOKENS

SIM = PromptTokenizer(str(SIM_MODEL_DIR))
FAST = Tokenizer.from_file(str(SIM_MODEL_DIR / "tokenizer.json"))
BUILTIN = BuiltinTokenizer()

texts = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.sampled_from([*SPECIAL_TOKENS, " ", "\n", "  ", "Übergrößenträger", "日本語"]),
        st.text(st.characters(codec="ascii"), max_size=40),
    ),
    max_size=8,
).map("".join)
contents = st.one_of(
    st.none(),
    texts,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=3),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), texts),
    lambda inner: st.dictionaries(texts, inner, max_size=3) | st.lists(inner, max_size=3),
    max_leaves=6,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": contents},
        optional={"tool_calls": st.lists(st.dictionaries(texts, json_values), max_size=2)},
    ),
    min_size=1,
    max_size=5,
)
tool_lists = st.none() | st.lists(st.dictionaries(texts, json_values, min_size=1), max_size=2)


@settings(max_examples=300, deadline=None)
@given(text=texts, special=st.booleans())
def test_a_client_loading_tokenizer_json_gets_the_simulators_ids(text: str, special: bool) -> None:
    ids = SIM.encode_prompt(text, add_special_tokens=special)
    assert FAST.encode(text, add_special_tokens=special).ids == ids
    assert FAST.decode(ids, skip_special_tokens=False).removeprefix("<s>" if special else "") == (
        text
    )


@settings(max_examples=200, deadline=None)
@given(conversation=messages, tools=tool_lists, generation=st.booleans())
def test_the_chat_template_renders_what_the_builtin_tokenizer_renders(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
) -> None:
    """Rendered with kvcore's loader, as the simulator renders it; and its ids are the
    rendered text's, encoded without special tokens, as vLLM does."""
    rendered = SIM.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=generation, tools=tools
    )
    assert rendered == BUILTIN.apply_chat_template(
        conversation, add_generation_prompt=generation, tools=tools
    )
    ids = SIM.encode_chat(conversation, tools=tools, add_generation_prompt=generation)
    assert FAST.encode(rendered, add_special_tokens=False).ids == ids


def test_generated_text_reads_back_as_the_ids_it_came_from() -> None:
    """Each filler word the simulator generates is one token of this vocabulary, so a
    client counting an answer's tokens counts what usage says."""
    assert [word for _, word in SIM.filler] == list(FILLER_WORDS)
    text = SIM.text_of(SIM.filler_ids)
    assert FAST.encode(text, add_special_tokens=False).ids == SIM.filler_ids


def test_config_json_says_what_clients_read_of_the_model() -> None:
    config = json.loads((SIM_MODEL_DIR / "config.json").read_text())
    assert config["vocab_size"] == FAST.get_vocab_size() == SIM.max_token_id + 1
    assert config["max_position_embeddings"] == MAX_POSITION_EMBEDDINGS
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert [FAST.id_to_token(i) for i in range(8)] == list(SPECIAL_TOKENS)


# -- transformers, where installed ---------------------------------------------------------


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SIM_MODEL_DIR))


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_transformers_encodes_as_the_simulator(auto_tokenizer: Any, text: str) -> None:
    assert auto_tokenizer(text)["input_ids"] == SIM.encode_prompt(text)
    assert auto_tokenizer.encode(text, add_special_tokens=False) == SIM.encode_prompt(
        text, add_special_tokens=False
    )


@settings(max_examples=80, deadline=None)
@given(conversation=messages, tools=tool_lists, generation=st.booleans())
def test_transformers_renders_and_tokenizes_chats_as_the_simulator(
    auto_tokenizer: Any,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation: bool,
) -> None:
    options = {"add_generation_prompt": generation, "tools": tools}
    rendered = auto_tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    assert rendered == SIM.tokenizer.apply_chat_template(conversation, **options)
    ids = auto_tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, **options
    )
    assert list(ids["input_ids"]) == SIM.encode_chat(conversation, **options)
