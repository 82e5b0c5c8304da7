"""Size the engine's paged KV cache from a memory budget, using the model's transformers config.

The continuous-batching engine keeps every sequence's keys and values in one cache of fixed-size
*pages*: a page holds ``page_tokens`` positions for every layer, so it costs
``bytes_per_page = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes x page_tokens``.
The cache is allocated once, when the engine starts; admission then counts pages, never bytes.

How many pages fit (``size_cache``)::

    budget = free - reserve - step_bytes
    pages  = budget / (bytes_per_page + page_tokens x read_bytes_per_token)   (rounded down,
                                                                              minus 3 spare pages)

* ``free``: what the memory probe says is free *after* the weights are loaded (a static budget
  has already taken the weights out, a device probe sees them as used), ``reserve``: what the
  operator keeps free for everything else (``vram_reserve``).
* ``step_bytes``: the transient peak of the largest step, ``max_batch_tokens`` tokens, that does
  not grow with the cache: per batch token the larger of the LM-head peak (hidden state plus
  float32 logits) and the attention peak (hidden state, query, new K and V, and K/V read back),
  plus the engine's index tensors; with eager/SDPA attention also the ``M x M`` corner of the
  attention mask. ``OVERHEAD_FRACTION`` is added for allocator rounding.
* ``read_bytes_per_token``: what each *cached* position adds to that peak, because the engine
  reads a sequence's whole K/V back at attention (``2 x heads + kv_heads`` heads under eager/SDPA,
  which repeat K/V to every query head; ``2 x kv_heads`` under flash attention), plus its read
  index and, under eager/SDPA, its column of the ``max_batch_tokens``-row attention mask.
* The 3 spare pages pay for the engine's two "trash" sectors and its rounding of the cache up to
  whole sectors.

This mirrors what the engine itself allocates (``workers.runners.engine`` states the version), so
an estimate that is off shows in ``scripts/gpu_check.py``'s "estimated vs allocated" line.
Sizes are written and read with ``parse_size``/``format_size`` ("512MiB", "16GB", "1.5 GiB").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zkqueue.errors import ConfigurationError
from zkqueue.plumbing.sizes import InvalidSize, format_size, parse_size

__all__ = ["InvalidSize", "format_size", "parse_size"]

#: Share of the step's transient bytes added for allocator rounding and fragmentation.
OVERHEAD_FRACTION = 0.10
#: Logits are computed in float32 whatever the model dtype.
LOGITS_DTYPE_BYTES = 4
#: Pages kept out of the count for the engine's trash sectors and sector rounding.
SPARE_PAGES = 3
#: Bytes of the engine's per-batch-token index tensors (seven int32 input rows, the int32 output,
#: a 32-entry int32 block table, the int64 write and read indices).
_IO_BYTES_PER_BATCH_TOKEN = 7 * 4 + 4 + 32 * 4 + 8 + 8
_INDEX_BYTES = 8


@dataclass(frozen=True)
class CachePlan:
    """The cache ``size_cache`` chose, with the figures behind it (all bytes)."""

    pages: int
    page_tokens: int
    bytes_per_page: int
    #: Transient bytes of the largest step once the cache is full-size.
    activation_bytes: int
    budget_bytes: int

    @property
    def cache_bytes(self) -> int:
        return self.pages * self.bytes_per_page


def kv_cache_bytes(config: Any, tokens: int, dtype_bytes: int) -> int:
    """Bytes of K and V cache that ``tokens`` positions take, for one sequence."""
    cfg = text_config(config)
    per_token = 2 * _num_layers(cfg) * _kv_heads(cfg) * _head_dim(cfg) * dtype_bytes
    return per_token * tokens


def bytes_per_page(config: Any, dtype_bytes: int, page_tokens: int) -> int:
    """Bytes of one page: ``page_tokens`` positions of K and V for every layer."""
    return kv_cache_bytes(config, page_tokens, dtype_bytes)


def step_bytes(config: Any, dtype_bytes: int, max_batch_tokens: int, flash: bool = False) -> int:
    """Transient bytes of a step of ``max_batch_tokens`` tokens that do not grow with the cache
    (see the module docstring), overhead included."""
    cfg = text_config(config)
    hidden, head_dim = int(cfg.hidden_size), _head_dim(cfg)
    heads, kv = _attention_heads(cfg), _kv_heads(cfg)
    lm_head = hidden * dtype_bytes + int(cfg.vocab_size) * LOGITS_DTYPE_BYTES
    attention = dtype_bytes * (hidden + heads * head_dim + 2 * kv * head_dim)
    attention += _read_heads(cfg, flash) * head_dim * dtype_bytes
    per_token = max(lm_head, attention) + _IO_BYTES_PER_BATCH_TOKEN
    mask = 0 if flash else max_batch_tokens * max_batch_tokens * dtype_bytes
    return math.ceil((max_batch_tokens * per_token + mask) * (1 + OVERHEAD_FRACTION))


def read_bytes_per_token(
    config: Any, dtype_bytes: int, max_batch_tokens: int, flash: bool = False
) -> int:
    """Transient bytes each cached position adds to the largest step, overhead included."""
    cfg = text_config(config)
    read = _read_heads(cfg, flash) * _head_dim(cfg) * dtype_bytes + _INDEX_BYTES
    mask = 0 if flash else max_batch_tokens * dtype_bytes
    return math.ceil((read + mask) * (1 + OVERHEAD_FRACTION))


def activation_bytes(
    config: Any, dtype_bytes: int, max_batch_tokens: int, cache_tokens: int, flash: bool = False
) -> int:
    """Transient peak of the largest step with a cache of ``cache_tokens`` positions."""
    per_cached = read_bytes_per_token(config, dtype_bytes, max_batch_tokens, flash)
    return step_bytes(config, dtype_bytes, max_batch_tokens, flash) + cache_tokens * per_cached


def size_cache(
    config: Any,
    dtype_bytes: int,
    *,
    free_bytes: int,
    reserve_bytes: int = 0,
    page_tokens: int = 32,
    max_batch_tokens: int = 256,
    flash: bool = False,
) -> CachePlan:
    """The most pages whose cache and step peak fit ``free_bytes - reserve_bytes`` (``pages`` may
    be 0 or less: the caller says no cache fits)."""
    if page_tokens < 1 or max_batch_tokens < 1:
        raise ConfigurationError("page_tokens and max_batch_tokens must be at least 1")
    page = bytes_per_page(config, dtype_bytes, page_tokens)
    budget = free_bytes - reserve_bytes - step_bytes(config, dtype_bytes, max_batch_tokens, flash)
    per_page = page + page_tokens * read_bytes_per_token(
        config, dtype_bytes, max_batch_tokens, flash
    )
    pages = budget // per_page - SPARE_PAGES if budget > 0 else 0
    peak = activation_bytes(config, dtype_bytes, max_batch_tokens, pages * page_tokens, flash)
    return CachePlan(max(0, pages), page_tokens, page, peak, max(0, budget))


def text_config(config: Any) -> Any:
    """The decoder's config: multimodal configs keep it under ``text_config``."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _read_heads(cfg: Any, flash: bool) -> int:
    """Heads' worth of K/V one cached position is read back as (eager/SDPA repeat K and V)."""
    return 2 * _kv_heads(cfg) if flash else 2 * _attention_heads(cfg) + _kv_heads(cfg)


def _num_layers(cfg: Any) -> int:
    return int(_first_attr(cfg, "num_hidden_layers", "n_layer", "num_layers"))


def _attention_heads(cfg: Any) -> int:
    return int(_first_attr(cfg, "num_attention_heads", "n_head"))


def _kv_heads(cfg: Any) -> int:
    kv = getattr(cfg, "num_key_value_heads", None)
    return int(kv) if kv else _attention_heads(cfg)


def _head_dim(cfg: Any) -> int:
    head_dim = getattr(cfg, "head_dim", None)
    return int(head_dim) if head_dim else int(cfg.hidden_size) // _attention_heads(cfg)


def _first_attr(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    raise ConfigurationError(f"model config has none of {', '.join(names)}; cannot estimate memory")
