"""Estimate the device memory a generation job needs, from the model's transformers config.

The weights are resident and counted once per worker; what each job adds is

* its KV cache: ``2 (K and V) x layers x kv_heads x head_dim x dtype_bytes x tokens`` where tokens
  is prompt tokens + max_new_tokens (the cache holds every position up to the last one);
* an activation allowance for the prefill, the largest transient step:
  ``prompt_tokens x (4 x hidden_size + 2 x intermediate_size) x dtype_bytes`` (the hidden state,
  query/key/value/attention outputs and the MLP's gate and up projections of one layer at a time;
  attention scores are not counted because SDPA/flash attention does not materialise them), plus
  ``2 x vocab_size x 4`` bytes for the float32 logits of the last position and their processed copy;
* ``OVERHEAD_FRACTION`` of the sum above for allocator rounding and fragmentation.

A batch costs more than the sum of its jobs because left padding makes every row as long as the
longest prompt and the batch generates for its largest ``max_new_tokens``: see ``batch_need_bytes``.
Sizes are written and read with ``parse_size``/``format_size`` ("512MiB", "16GB", "1.5 GiB").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zkqueue.errors import ConfigurationError
from zkqueue.sizes import InvalidSize, format_size, parse_size

__all__ = ["InvalidSize", "format_size", "parse_size"]

#: Share of the KV cache + activations added for allocator rounding and fragmentation.
OVERHEAD_FRACTION = 0.10
#: Logits are computed in float32 whatever the model dtype.
LOGITS_DTYPE_BYTES = 4


def kv_cache_bytes(config: Any, tokens: int, dtype_bytes: int) -> int:
    """Bytes of K and V cache that ``tokens`` positions take, for one sequence."""
    cfg = text_config(config)
    per_token = 2 * _num_layers(cfg) * _kv_heads(cfg) * _head_dim(cfg) * dtype_bytes
    return per_token * tokens


def activation_bytes(config: Any, prompt_tokens: int, dtype_bytes: int) -> int:
    """Transient bytes of the prefill step for one sequence (see the module docstring)."""
    cfg = text_config(config)
    hidden = int(cfg.hidden_size)
    intermediate = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    per_token = (4 * hidden + 2 * intermediate) * dtype_bytes
    logits = 2 * int(cfg.vocab_size) * LOGITS_DTYPE_BYTES
    return prompt_tokens * per_token + logits


def job_need_bytes(config: Any, prompt_tokens: int, max_new_tokens: int, dtype_bytes: int) -> int:
    """Estimated device bytes one job adds on top of the resident weights."""
    return batch_need_bytes(config, [prompt_tokens], [max_new_tokens], dtype_bytes)


def batch_need_bytes(
    config: Any, prompt_tokens: Sequence[int], max_new_tokens: Sequence[int], dtype_bytes: int
) -> int:
    """Estimated bytes of one batched generate: every row padded to the longest prompt and run
    for the largest ``max_new_tokens``."""
    if len(prompt_tokens) != len(max_new_tokens):
        raise ValueError("prompt_tokens and max_new_tokens must have the same length")
    if not prompt_tokens:
        return 0
    rows, longest, new = len(prompt_tokens), max(prompt_tokens), max(max_new_tokens)
    raw = rows * (
        kv_cache_bytes(config, longest + new, dtype_bytes)
        + activation_bytes(config, longest, dtype_bytes)
    )
    return math.ceil(raw * (1 + OVERHEAD_FRACTION))


def text_config(config: Any) -> Any:
    """The decoder's config: multimodal configs keep it under ``text_config``."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


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
