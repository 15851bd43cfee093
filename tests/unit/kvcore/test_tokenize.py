"""Tokenizers: the built-in one is fully specified; the HF one matches the model's files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as FastTokenizer

from bench.micro.model_files import train_tiny_bpe, write_config
from kvcore.tokenize import (
    BuiltinTokenizer,
    ChatTemplateError,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)
from tests.unit.kvcore.conftest import TOOLS_TEMPLATE

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is KV cache reuse?"},
]


def _reference_builtin_ids(text: str) -> list[int]:
    """The docstring's rule, implemented independently."""
    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    specials += ["<|tool|>", "<|end|>"]
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(specials.index(part))
            continue
        for piece in re.findall(r"\s*(?:\w{1,8}|[^\w\s])|\s+", part):
            ids.append(256 + xxhash.xxh3_64_intdigest(piece.encode()) % 31744)
    return ids


def test_builtin_tokenizer_follows_its_documented_rule() -> None:
    text = "<s>Hello, world!\n  internationalization <|end|> tail  "
    ids = BuiltinTokenizer().encode(text, add_special_tokens=False)
    assert ids == _reference_builtin_ids(text)
    assert ids[0] == 1 and 7 in ids


def test_builtin_counts_about_one_token_per_short_word() -> None:
    tokenizer = BuiltinTokenizer()
    assert len(tokenizer.encode("the cat sat on the mat.", add_special_tokens=False)) == 7
    assert tokenizer.encode("hi") == [1, *tokenizer.encode("hi", add_special_tokens=False)]
    assert len(tokenizer.encode("internationalization", add_special_tokens=False)) == 3


def test_builtin_ids_golden_vector() -> None:
    # enginesim and the proxy must agree across versions: changing these breaks routing.
    assert BuiltinTokenizer().encode("Hello world") == [1, 25366, 15921]


def test_builtin_chat_template_renders_the_documented_layout() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = BuiltinTokenizer().apply_chat_template(CHAT, tools=tools)
    assert text == (
        "<s><|system|>\nTools:\n"
        '{"function":{"name":"f"},"type":"function"}\n<|end|>\n'
        "<|system|>\nYou are terse.<|end|>\n"
        "<|user|>\nWhat is KV cache reuse?<|end|>\n"
        "<|assistant|>\n"
    )
    no_prompt = BuiltinTokenizer().apply_chat_template(CHAT, add_generation_prompt=False)
    assert no_prompt.endswith("reuse?<|end|>\n")


def test_builtin_chat_accepts_text_parts_and_tool_calls() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
    ]
    text = BuiltinTokenizer().apply_chat_template(messages, add_generation_prompt=False)
    assert text == '<s><|user|>\nab<|end|>\n<|assistant|>\n\n{"id":"c1"}<|end|>\n'


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "wizard", "content": "x"}, r"messages\[0\]\.role"),
        ({"role": "user", "content": [{"type": "image_url"}]}, r"messages\[0\]\.content"),
        ({"role": "user", "content": 5}, r"messages\[0\]\.content"),
    ],
)
def test_builtin_chat_refuses_malformed_messages_naming_the_field(
    message: dict[str, object], field: str
) -> None:
    with pytest.raises(ChatTemplateError, match=field):
        BuiltinTokenizer().apply_chat_template([message])


def test_both_tokenizers_satisfy_the_protocol(hf_model_dir: Path) -> None:
    assert isinstance(BuiltinTokenizer(), Tokenizer)
    assert isinstance(HFTokenizer(hf_model_dir), Tokenizer)


def test_hf_tokenizer_encodes_exactly_like_tokenizers(hf_model_dir: Path) -> None:
    reference = FastTokenizer.from_file(str(hf_model_dir / "tokenizer.json"))
    tokenizer = HFTokenizer(hf_model_dir)
    text = "The quick brown fox, über café!\n12345"
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.encode_batch([text, "fox"]) == [
        reference.encode(text, add_special_tokens=False).ids,
        reference.encode("fox", add_special_tokens=False).ids,
    ]


def test_hf_special_tokens_come_from_the_config(hf_model_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_model_dir)
    reference = FastTokenizer.from_file(str(hf_model_dir / "tokenizer.json"))
    assert tokenizer.eos_token_id == reference.token_to_id("<|im_end|>")
    assert tokenizer.bos_token_id == reference.token_to_id("<s>")
    assert tokenizer.name == hf_model_dir.name


def test_hf_chat_template_renders_with_engine_variables(hf_model_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_model_dir)
    text = tokenizer.apply_chat_template(CHAT)
    assert text == (
        "<s><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is KV cache reuse?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = tokenizer.fast.token_to_id("<|im_start|>")
    assert ids[0] == tokenizer.bos_token_id and ids.count(start) == 3


def test_hf_template_raise_exception_is_a_chat_template_error(hf_model_dir: Path) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role wizard"):
        HFTokenizer(hf_model_dir).apply_chat_template([{"role": "wizard", "content": "x"}])


def _model_dir(tmp_path: Path, source: Path, **config: object) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")
    write_config(directory, **config)
    return directory


def test_hf_tools_are_passed_to_the_template(tmp_path: Path, hf_model_dir: Path) -> None:
    directory = _model_dir(tmp_path, hf_model_dir, chat_template=TOOLS_TEMPLATE, bos_token="")
    tools = [{"name": "get_weather", "description": "météo"}]
    text = HFTokenizer(directory).apply_chat_template(CHAT, tools=tools)
    assert text.startswith(f"<|im_start|>system\n{json.dumps(tools[0], ensure_ascii=False)}\n")


def test_hf_named_templates_pick_tool_use_when_tools_given(
    tmp_path: Path, hf_model_dir: Path
) -> None:
    named = [
        {"name": "default", "template": "plain{{ messages | length }}"},
        {"name": "tool_use", "template": "tools{{ tools | length }}"},
    ]
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir, chat_template=named))
    assert tokenizer.apply_chat_template(CHAT) == "plain2"
    assert tokenizer.apply_chat_template(CHAT, tools=[{"name": "f"}]) == "tools1"


def test_hf_template_globals_and_generation_blocks(tmp_path: Path, hf_model_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir, chat_template=template))
    assert tokenizer.apply_chat_template(CHAT) == "[You are terse.]4"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (  # jinja's own globals (range, namespace, cycler, joiner) and a top-level set
            "{% set ns = namespace(n=0) %}{% set row = cycler('a', 'b') %}"
            "{% set comma = joiner(',') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
            "{{ comma() }}{{ row.next() }}{{ m.role }}{% endfor %}"
            "|{{ ns.n }}|{{ range(3) | list | length }}",
            "asystem,buser|2|3",
        ),
        (  # a macro, loop.last, tojson, add_generation_prompt
            "{% macro turn(m) %}<{{ m.role }}>{{ m.content | tojson }}{% endmacro %}"
            "{% for m in messages %}{{ turn(m) }}{% if not loop.last %};{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            '<system>"You are terse.";<user>"What is KV cache reuse?"<assistant>',
        ),
    ],
)
def test_hf_templates_render_as_jinja_renders_them(
    tmp_path: Path, hf_model_dir: Path, template: str, expected: str
) -> None:
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir, chat_template=template))
    assert tokenizer.apply_chat_template(CHAT) == expected
    assert tokenizer.apply_chat_template(CHAT) == expected  # nothing left from the first


def test_hf_template_state_does_not_leak_between_renders(
    tmp_path: Path, hf_model_dir: Path
) -> None:
    template = "{% if seen is defined %}again{% endif %}{% set seen = 1 %}{{ messages | length }}"
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir, chat_template=template))
    assert [tokenizer.apply_chat_template(CHAT) for _ in range(2)] == ["2", "2"]
    assert tokenizer.apply_chat_template(CHAT[:1]) == "1"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set xs = [] %}{{ xs.append(1) }}",
    ],
)
def test_hf_templates_run_sandboxed(tmp_path: Path, hf_model_dir: Path, template: str) -> None:
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir, chat_template=template))
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template(CHAT)


def test_hf_template_from_chat_template_jinja_file(tmp_path: Path, hf_model_dir: Path) -> None:
    directory = _model_dir(tmp_path, hf_model_dir)
    (directory / "chat_template.jinja").write_text("n={{ messages | length }}", encoding="utf-8")
    assert HFTokenizer(directory).apply_chat_template(CHAT) == "n=2"


def test_hf_without_template_refuses_chat(tmp_path: Path, hf_model_dir: Path) -> None:
    tokenizer = HFTokenizer(_model_dir(tmp_path, hf_model_dir))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)


def test_load_tokenizer_specs(hf_model_dir: Path) -> None:
    assert isinstance(load_tokenizer("builtin"), BuiltinTokenizer)
    assert isinstance(load_tokenizer(str(hf_model_dir)), HFTokenizer)


def test_load_tokenizer_errors_are_clear(tmp_path: Path, hf_model_dir: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="empty"):
        load_tokenizer("")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(str(tmp_path / "broken"))
    assert issubclass(TokenizerError, ValueError)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{bad", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"eos_token": 5}', "eos_token"),
        ('{"chat_template": 5}', "chat_template"),
        ('{"chat_template": "{% if %}"}', "does not compile"),
    ],
)
def test_invalid_config_is_refused_at_load(
    tmp_path: Path, hf_model_dir: Path, config: str, message: str
) -> None:
    directory = _model_dir(tmp_path, hf_model_dir)
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")
    with pytest.raises(TokenizerError, match=message):
        HFTokenizer(directory)


def test_training_fixture_is_a_real_bpe(tmp_path: Path) -> None:
    fast = train_tiny_bpe(tmp_path / "m", vocab_size=300)
    assert fast.get_vocab_size() == 300
    assert len(fast.encode("the quick brown fox").ids) < len("the quick brown fox")


_WORDS_ALPHABET = [
    "a", "Zq", "é", "字", "_", "7", "internationalization", ",", ".", "!", "'",
    " ", "  ", "\t", "\n", "\xa0", "\u2003", "\x1c", "<", "s>", "<s>", "<|end|>",
]  # fmt: skip
_SHARED = BuiltinTokenizer()  # its word memo carries over from text to text
_FORGETFUL = BuiltinTokenizer()  # its memos restart every few words
_FORGETFUL._words_memo_limit = 3


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(_WORDS_ALPHABET), max_size=24), start=st.integers(0, 30))
def test_builtin_words_between_single_spaces_are_remembered_without_changing_a_token(
    parts: list[str], start: int
) -> None:
    """Texts of words between single spaces are encoded word by word from a memo; every
    text, of that shape or not, still follows the documented rule, also from an offset
    (what the prefix cache asks for a new tail)."""
    text = "".join(parts)
    for tokenizer in (BuiltinTokenizer(), _SHARED, _FORGETFUL):
        assert tokenizer.encode(text, add_special_tokens=False) == _reference_builtin_ids(text)
        spaced = " ".join(parts)
        assert tokenizer.encode(spaced, add_special_tokens=False) == _reference_builtin_ids(spaced)
        assert tokenizer.encode(spaced) == [1, *_reference_builtin_ids(spaced)]  # BOS first
        start = min(start, len(spaced))
        assert tokenizer.encode_from(spaced, start) == _reference_builtin_ids(spaced[start:])
