"""Request bodies a fuzz test sends to the proxy: JSON objects made of the inference
fields with any JSON values, and chat bodies whose messages' contents are any JSON."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "cache_salt",
    "prompt_cache_key",
    "tools",
    "user",
    "n",
    "text",
    "input_ids",
    "sampling_params",
]  # fmt: skip (the last three: /generate's)


def request_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies for ``model`` (which the strategy also draws as any field's value)."""
    return st.dictionaries(
        st.sampled_from(FIELDS), JSON_VALUES | st.just(model), max_size=6
    ) | st.builds(
        lambda extra, messages: {"model": model, "messages": messages, **extra},
        st.dictionaries(st.sampled_from(FIELDS[3:]), JSON_VALUES, max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                        "content": JSON_VALUES}), max_size=3),
    )  # fmt: skip
