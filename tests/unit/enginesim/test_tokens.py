"""The highest prompt token id the simulator serves in vLLM mode: vLLM's bound, the larger
of the tokenizer's highest id and the model's ``vocab_size`` - 1."""

from __future__ import annotations

import json
from pathlib import Path

from bench.micro.model_files import write_tiny_model
from enginesim.tokens import PromptTokenizer


def test_the_builtin_tokenizer_is_a_model_of_32000_ids() -> None:
    assert PromptTokenizer("builtin").max_token_id == 31_999


def test_a_model_directory_bounds_ids_by_its_tokenizer_or_its_config(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", vocab_size=400)
    alone = PromptTokenizer(str(model)).max_token_id
    assert 300 < alone < 400  # its trained vocabulary, added tokens included
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}), encoding="utf-8")
    assert PromptTokenizer(str(model)).max_token_id == 511  # the model's rows beyond
    nested = {"text_config": {"vocab_size": 1024}}
    (model / "config.json").write_text(json.dumps(nested), encoding="utf-8")
    assert PromptTokenizer(str(model)).max_token_id == 1023
    (model / "config.json").write_text(json.dumps({"vocab_size": 8}), encoding="utf-8")
    assert PromptTokenizer(str(model)).max_token_id == alone  # the tokenizer's, if larger
    (model / "config.json").write_text("not json", encoding="utf-8")
    assert PromptTokenizer(str(model)).max_token_id == alone
