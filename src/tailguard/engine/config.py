"""The engine model's settings, named after vLLM's engine arguments.

A module of its own, outside the compiled hot path (``setup.py``): the
configuration layer reads the dataclass's fields to build the scenario and
fleet file formats and their JSON Schemas.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler settings, named after vLLM's engine arguments.

    ``kv_capacity_tokens`` None takes the capacity from the performance model.
    With ``enable_chunked_prefill`` False a prompt is prefilled whole in one
    step; the first prompt of a step may exceed the token budget (the budget
    is raised to fit it), later ones must fit in what is left.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    # vLLM V1's automatic prefix caching is on by default (engine/prefix_cache.py).
    enable_prefix_caching: bool = True
    # vLLM's ``--long-prefill-token-threshold``: with chunked prefill, a prompt
    # computes at most this many tokens a step, leaving the rest of the budget to
    # the prompts behind it (0: no cap, the whole budget in admission order).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "must be >= 1")
        if self.block_size < 1:
            raise ConfigError("block_size", "must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold", "must be >= 0 (0: no cap)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running sequence needs a decode token.
            raise ConfigError("max_num_batched_tokens", "must be >= max_num_seqs")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ConfigError("kv_capacity_tokens", "must hold at least one block")


__all__ = ["EngineConfig"]
