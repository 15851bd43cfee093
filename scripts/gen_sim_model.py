"""Write the simulated model's Hugging Face files into enginesim/models/sim-model/.

The built-in tokenizer (``kvcore.tokenize.builtin``) gives each piece of text the id
``256 + xxh3_64(piece) % 31744``: an id computed from an unbounded set of pieces, which
no ``tokenizers`` model (BPE, WordPiece, WordLevel, Unigram: each a finite vocabulary)
can express. So the simulated model that benchmark clients load is a tokenizer of its
own, which the simulator then runs too (``kvroute-sim --tokenizer DIR``, as for any
model folder): its rules are the built-in's wherever a ``tokenizers`` pipeline can have
them, and the files are committed, so every client, the proxy and the engine read the
same ones.

- Special tokens: the built-in's eight, with its ids (``<pad>`` 0, ``<s>`` 1, ``</s>``
  2, ``<|system|>`` 3, ``<|user|>`` 4, ``<|assistant|>`` 5, ``<|tool|>`` 6, ``<|end|>``
  7), cut out first; ``<s>`` is prepended when special tokens are added.
- Pieces: the built-in's regular expression, ``\\s*(?:\\w{1,8}|[^\\w\\s])|\\s+``, then
  byte-level BPE within each piece, trained here on the repository's documentation
  (with the simulator's filler words, so that each is one token and generated text
  reads back as the ids it came from). A common word with its leading space is one
  token, as in the built-in; a rare one takes a few.
- The chat template renders exactly what the built-in's does (its docstring).

Training is deterministic but its corpus (docs/) changes with the project: the files
are the model, written once; run this only to make a new one.

Usage: python scripts/gen_sim_model.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from enginesim.sim_model import CHAT_TEMPLATE, MAX_POSITION_EMBEDDINGS, SIM_MODEL_DIR, SPLIT
from enginesim.tokens import FILLER_WORDS
from kvcore.tokenize.builtin import BOS, EOS, PAD, SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 8000


def corpus() -> Iterator[str]:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield from path.read_text(encoding="utf-8").splitlines(keepends=True)
    for _ in range(50):
        yield "".join(FILLER_WORDS)


def train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    assert [tokenizer.token_to_id(token) for token in specials] == list(range(len(specials)))
    bos = SPECIAL_TOKENS[BOS]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def main() -> None:
    tokenizer = train()
    SIM_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(SIM_MODEL_DIR / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    model = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "bos_token_id": SPECIAL_TOKENS[BOS],
        "eos_token_id": SPECIAL_TOKENS[EOS],
        "pad_token_id": SPECIAL_TOKENS[PAD],
    }
    for name, content in (("tokenizer_config.json", config), ("config.json", model)):
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        (SIM_MODEL_DIR / name).write_text(text, encoding="utf-8")
    print(f"wrote {SIM_MODEL_DIR} (vocabulary of {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
