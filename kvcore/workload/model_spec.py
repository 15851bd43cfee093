"""Model entries: what a proxy needs to key a model's prompts (etcd ``models/<name>``).

An operator names each model the fleet serves once: which tokenizer turns its prompts
into the token ids the engines see (``builtin`` or a directory holding the model's
``tokenizer.json``, readable by every proxy), the router block size, and the pool of
replicas serving it. The entry's ``name`` is an etcd key segment, so an engine's model id
such as ``meta-llama/Llama-3.1-8B`` goes in ``model`` (the id the sidecars announce and
block keys' root is built from) and any aliases clients use in ``served_names``.
"""

from __future__ import annotations

from pydantic import Field

from kvcore.keys import DEFAULT_BLOCK_SIZE
from kvcore.workload.model import NAME_PATTERN, _Settings


class ModelSpec(_Settings):
    """One model the proxies route for."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Entry name: letters, digits, '_' and '-', at most 64 characters.",
    )
    model: str = Field(
        "",
        max_length=256,
        description="The model id the engines serve and the sidecars announce (block keys "
        "are rooted at it); empty: the entry's name.",
    )
    served_names: tuple[str, ...] = Field(
        (), max_length=64, description="Other model names clients may ask for."
    )
    tokenizer: str = Field(
        "builtin",
        min_length=1,
        max_length=4096,
        description="'builtin', or a directory with the model's tokenizer.json that every "
        "proxy can read.",
    )
    block_size: int = Field(
        DEFAULT_BLOCK_SIZE, ge=1, le=4096, description="Router block size in tokens."
    )
    pool: str = Field("default", pattern=NAME_PATTERN, description="Pool serving the model.")

    @property
    def canonical(self) -> str:
        """The model id block keys are rooted at."""
        return self.model or self.name

    def answers_to(self, requested: str) -> bool:
        """Whether a request for ``requested`` is for this model."""
        return requested in (self.name, self.canonical) or requested in self.served_names
