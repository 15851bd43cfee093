"""Fixtures for the kvcore unit tests: model tokenizer files built here, never downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer the question using the documents below.",
    "The quick brown fox jumps over the lazy dog; 12345 numbers, punctuation!?",
    "def route(request):\n    return max(replicas, key=score)\n",
    "Größe, naïve café — unicode text über alles. 日本語のテキスト。",
] * 20


def train_tiny_bpe(directory: Path, *, vocab_size: int = 400) -> Tokenizer:
    """A small byte-level BPE in the style of GPT-2/Llama 3, saved as tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def write_config(directory: Path, **config: Any) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with tokenizer.json and a ChatML tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("tiny-chatml")
    train_tiny_bpe(directory)
    write_config(
        directory,
        chat_template=CHATML_TEMPLATE,
        bos_token={"content": "<s>", "lstrip": False, "rstrip": False},
        eos_token="<|im_end|>",
    )
    return directory
