"""Typed settings of ``kvroute-sim``: every flag, its default, and its environment variable.

Each field is a flag (``--block-size``) and an environment variable
(``KVROUTE_BLOCK_SIZE``); a flag given on the command line wins over the environment.
The names in the brief's command table are a contract used by tests, the local launcher
and ``deploy/``. Everything binds to loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, FilePath, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from enginesim.errors import SettingsError
from enginesim.lora import parse_modules
from enginesim.timing import TimingModel
from kvruntime.flags import flags_given, settings_parser

DEFAULT_MAX_MODEL_LEN = 32768


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8100, ge=0, le=65535, description="HTTP port (0: a free port)")
    model: str = Field("kvroute/sim-model", description="served model name")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block (SGLang page)")
    num_blocks: int = Field(8192, ge=1, description="KV blocks in the pool")
    max_num_seqs: int = Field(256, ge=1, description="most requests running at once")
    max_model_len: int | None = Field(
        None, ge=2, description="prompt + output limit, in tokens (min(32768, pool size))"
    )
    kv_events_endpoint: str = Field("tcp://127.0.0.1:5557", description="ZMQ PUB bind address")
    replay_endpoint: str = Field(
        "tcp://127.0.0.1:5558", description="ZMQ ROUTER bind address for replay ('' = off)"
    )
    replay_buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    topic: str = Field("", description="ZMQ topic frame")
    event_format: Literal["vllm", "vllm-0.23", "sglang"] = Field(
        "vllm", description="KV event wire format and metric names"
    )
    tokenizer: str = Field("builtin", description="'builtin' or a model directory")
    time_scale: float = Field(1.0, ge=0.0, description="wall seconds per modelled second")
    instant: bool = Field(False, description="steps take no time (functional tests)")
    prefill_rate: float = Field(10_000.0, gt=0, description="prefill tokens per second")
    prefill_overhead_ms: float = Field(5.0, ge=0, description="fixed cost per prefill")
    prefill_quadratic: float = Field(0.0, ge=0, description="s per uncached*context token")
    decode_base_ms: float = Field(10.0, ge=0, description="decode step cost at batch 0")
    decode_per_seq_ms: float = Field(0.2, ge=0, description="decode step cost per running seq")
    kv_transfer_block_ms: float = Field(
        0.05, ge=0, description="modelled time a decode engine takes to read one KV block"
    )
    kv_lease_s: float = Field(
        30.0, gt=0, description="seconds a prefill holds blocks for its decode engine"
    )
    disaggregation_mode: Literal["null", "prefill", "decode"] = Field(
        "null",
        description="SGLang mode: this server's half of a P/D pair, as SGLang's flag "
        "(the bootstrap server is the HTTP port)",
    )
    disaggregation_decode_enable_radix_cache: bool = Field(
        False,
        description="SGLang mode: a decode server keeps a radix cache (shares prefixes, "
        "reads only what it lacks, publishes KV events), as SGLang's flag; without it a "
        "decode server's cache holds nothing and publishes nothing (SGLang's default)",
    )
    log_level: str = Field("warning", description="log level of the server")
    no_cache_report: bool = Field(
        False,
        description="report no cached tokens in usage, as vLLM without "
        "--enable-prompt-tokens-details and SGLang without --enable-cache-report answer "
        "(their defaults); without it, as with those flags",
    )
    request_header_overrides: bool = Field(
        False,
        description="SGLang mode: a chat's x-override-rid header names it, as "
        "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 makes SGLang do",
    )
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (vLLM's and SGLang's --enable-lora)"
    )
    lora_modules: str = Field(
        "",
        description="vLLM mode: adapters loaded at start, space-separated 'name=path' or "
        "JSON {name, path, base_model_name} items (vLLM's --lora-modules forms)",
    )
    lora_paths: str = Field(
        "",
        description="SGLang mode: adapters loaded at start, space-separated 'name=path', "
        "'path' or JSON {lora_name, lora_path, pinned} items (SGLang's --lora-paths forms)",
    )
    max_loras: int = Field(
        1,
        ge=1,
        description="most adapters among running requests (vLLM's --max-loras; SGLang's "
        "--max-loras-per-batch)",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM mode: adapters whose weights stay in memory, least recently used "
        "out; a request for a cold one waits for its load (max_loras when unset)",
    )
    max_loaded_loras: int | None = Field(
        None,
        ge=1,
        description="SGLang mode: adapters registered at once; loading one more unloads the "
        "least recently used unpinned one (SGLang's --max-loaded-loras)",
    )
    lora_load_ms: float = Field(
        20.0, ge=0, description="modelled time to load one adapter's weights"
    )
    ssl_keyfile: FilePath | None = Field(
        None, description="serve HTTPS with this private key (PEM), as vLLM's and SGLang's flag"
    )
    ssl_certfile: FilePath | None = Field(
        None, description="serve HTTPS with this certificate (PEM), as vLLM's and SGLang's flag"
    )

    @model_validator(mode="after")
    def _check_tls(self) -> SimSettings:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> SimSettings:
        sglang = self.event_format == "sglang"
        if self.lora_modules and sglang:
            raise ValueError("lora_modules is vLLM's: SGLang mode takes lora_paths")
        if self.lora_paths and not sglang:
            raise ValueError("lora_paths is SGLang's: vLLM mode takes lora_modules")
        if (self.lora_modules or self.lora_paths) and not self.enable_lora:
            raise ValueError("adapters at start need enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        try:
            parse_modules(self.lora_paths or self.lora_modules, sglang=sglang)
        except ValueError as exc:
            raise ValueError(f"lora_{'paths' if sglang else 'modules'}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> SimSettings:
        if self.max_model_len is not None and self.max_model_len > self.pool_tokens:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV pool "
                f"({self.num_blocks} blocks x {self.block_size} tokens)"
            )
        return self

    @model_validator(mode="after")
    def _check_sglang_only(self) -> SimSettings:
        if self.request_header_overrides and self.event_format != "sglang":
            raise ValueError("request_header_overrides is SGLang's: it needs event_format sglang")
        if self.disaggregation_mode != "null" and self.event_format != "sglang":
            raise ValueError("disaggregation_mode is SGLang's: it needs event_format sglang")
        if self.disaggregation_decode_enable_radix_cache and self.event_format != "sglang":
            raise ValueError(
                "disaggregation_decode_enable_radix_cache is SGLang's: it needs event_format sglang"
            )
        return self

    @property
    def disable_radix_cache(self) -> bool:
        """SGLang's resolved ``disable_radix_cache``: a decode server's unless it was
        started with ``--disaggregation-decode-enable-radix-cache``
        (``handle_pd_disaggregation``)."""
        return (
            self.disaggregation_mode == "decode"
            and not self.disaggregation_decode_enable_radix_cache
        )

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def model_len(self) -> int:
        """The effective ``max_model_len``."""
        return self.max_model_len or min(DEFAULT_MAX_MODEL_LEN, self.pool_tokens)

    def timing(self) -> TimingModel:
        return TimingModel(
            prefill_rate=self.prefill_rate,
            prefill_overhead_s=self.prefill_overhead_ms / 1000,
            prefill_quadratic_s=self.prefill_quadratic,
            decode_base_s=self.decode_base_ms / 1000,
            decode_per_seq_s=self.decode_per_seq_ms / 1000,
        )


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        SimSettings,
        prog="kvroute-sim",
        description="A simulated vLLM/SGLang engine: real prefix cache, KV events, metrics.",
    )


def parse_settings(argv: Sequence[str] | None = None) -> SimSettings:
    try:
        return SimSettings(**flags_given(build_parser(), argv))
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from exc


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
