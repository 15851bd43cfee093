"""Fixtures for the kvcore unit tests: model tokenizer files built here, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.micro.model_files import CHATML_TEMPLATE, write_tiny_model

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE
)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with tokenizer.json and a ChatML tokenizer_config.json."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-chatml"))
