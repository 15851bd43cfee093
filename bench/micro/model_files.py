"""Model tokenizer files built on the spot, for benchmarks and tests: nothing is downloaded.

``write_tiny_model`` trains a small BPE with the pre-tokenizer of a real model family
(GPT-2, Llama 3, SentencePiece-like Metaspace) and writes the ``tokenizer.json`` and
``tokenizer_config.json`` a model directory holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer the question using the documents below.",
    "The quick brown fox jumps over the lazy dog; 12345 numbers, punctuation!?",
    "def route(request):\n    return max(replicas, key=score)\n",
    "Größe, naïve café — unicode text über alles. 日本語のテキスト。",
    "Replica seven holds the prefix; the router sends the request there unless it is busy.",
] * 20
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "gpt2-prefix-space": lambda: pre_tokenizers.ByteLevel(add_prefix_space=True),
    "llama3": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
    "metaspace": lambda: pre_tokenizers.Metaspace(),
}


def train_tiny_bpe(
    directory: Path,
    *,
    vocab_size: int = 400,
    style: str = "gpt2",
    corpus: Sequence[str] = CORPUS,
) -> Tokenizer:
    """A small BPE with a real model family's pre-tokenizer, saved as ``tokenizer.json``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[style]()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def write_config(directory: Path, **config: Any) -> None:
    """Write ``tokenizer_config.json`` with these fields."""
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def write_tiny_model(
    directory: Path, *, vocab_size: int = 400, style: str = "gpt2", corpus: Sequence[str] = CORPUS
) -> Path:
    """A ChatML model directory: trained ``tokenizer.json`` and a chat-template config."""
    train_tiny_bpe(directory, vocab_size=vocab_size, style=style, corpus=corpus)
    write_config(
        directory,
        chat_template=CHATML_TEMPLATE,
        bos_token={"content": "<s>", "lstrip": False, "rstrip": False},
        eos_token="<|im_end|>",
    )
    return directory
