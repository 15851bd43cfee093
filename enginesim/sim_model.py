"""The simulated model's Hugging Face folder, shipped with the simulator.

Benchmark clients (guidellm, ``vllm bench serve``, ``sglang.bench_serving``) count and
make prompts with the model's tokenizer, loaded from a folder of Hugging Face files; the
built-in tokenizer has none (its ids are a hash of each piece, which no ``tokenizers``
model can express: ``scripts/gen_sim_model.py`` says why and how these files were
made). :data:`SIM_MODEL_DIR` holds ``tokenizer.json``, ``tokenizer_config.json`` (with
:data:`CHAT_TEMPLATE`) and ``config.json``; a simulator started with
``--tokenizer SIM_MODEL_DIR`` tokenizes with them, so a client, the proxy
(``--tokenizer`` the same folder) and the engine agree on every id.
"""

from __future__ import annotations

from pathlib import Path

SIM_MODEL_DIR = Path(__file__).resolve().parent / "models" / "sim-model"
MAX_POSITION_EMBEDDINGS = 32_768
# the built-in tokenizer's pieces (kvcore.tokenize.builtin), in Oniguruma's syntax
SPLIT = r"\s*(?:\w{1,8}|[^\w\s])|\s+"

_JSON = "tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True)"
_ROLES = "['assistant', 'system', 'tool', 'user']"
# The built-in tokenizer's chat template (its docstring), for transformers' Jinja
# environment and kvcore's alike; one line, so no whitespace control is involved.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\\nTools:\\n' }}"
    "{% for tool in tools %}{{ tool | " + _JSON + " }}{{ '\\n' }}{% endfor %}"
    "{{ '<|end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% set index = loop.index0 %}"
    "{% if message['role'] not in " + _ROLES + " %}"
    '{{ raise_exception("messages[" ~ index ~ "].role must be one of ' + _ROLES + '") }}'
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part is not mapping or part['type'] != 'text' or part['text'] is not defined %}"
    "{{ raise_exception('messages[' ~ index ~ '].content must be a string or a list "
    "of text parts') }}{% endif %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '\\n' }}{{ call | " + _JSON + " }}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
