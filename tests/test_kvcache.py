"""The memory estimate and the size syntax used by budgets."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import GPT2Config, LlamaConfig

from workers import kvcache
from workers.kvcache import (
    InvalidSize,
    activation_bytes,
    batch_need_bytes,
    format_size,
    job_need_bytes,
    kv_cache_bytes,
    parse_size,
)
from zkqueue.errors import ConfigurationError


def llama_7b_like() -> LlamaConfig:
    """A Llama-like 7B config with grouped-query attention (no weights are built)."""
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )


def test_kv_cache_of_a_7b_gqa_config() -> None:
    cfg = llama_7b_like()
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_token == 131072
    assert kv_cache_bytes(cfg, 1, 2) == per_token
    assert kv_cache_bytes(cfg, 4096, 2) == 4096 * per_token  # 512 MiB
    assert kv_cache_bytes(cfg, 1000, 4) == 2 * 1000 * per_token


def test_kv_heads_default_to_attention_heads() -> None:
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert kv_cache_bytes(cfg, 10, 4) == 2 * 2 * 4 * 16 * 4 * 10


def test_explicit_head_dim_wins() -> None:
    cfg = LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
    )
    assert kv_cache_bytes(cfg, 1, 2) == 2 * 4 * 1 * 256 * 2


def test_gpt2_style_attribute_names() -> None:
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768)
    assert kv_cache_bytes(cfg, 1, 2) == 2 * 12 * 12 * 64 * 2


def test_config_without_layers_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="num_hidden_layers"):
        kv_cache_bytes(SimpleNamespace(hidden_size=8, num_attention_heads=2), 1, 2)


def test_job_need_is_kv_plus_activations_plus_overhead() -> None:
    cfg = llama_7b_like()
    kv = kv_cache_bytes(cfg, 1000 + 200, 2)
    act = 1000 * (4 * 4096 + 2 * 14336) * 2 + 2 * 32000 * 4
    assert activation_bytes(cfg, 1000, 2) == act
    expected = math.ceil((kv + act) * (1 + kvcache.OVERHEAD_FRACTION))
    assert job_need_bytes(cfg, 1000, 200, 2) == expected


def test_batch_pads_to_the_longest_prompt_and_largest_max_new_tokens() -> None:
    cfg = llama_7b_like()
    batch = batch_need_bytes(cfg, [10, 500], [300, 20], 2)
    per_row = kv_cache_bytes(cfg, 500 + 300, 2) + activation_bytes(cfg, 500, 2)
    assert batch == math.ceil(2 * per_row * (1 + kvcache.OVERHEAD_FRACTION))
    assert batch > job_need_bytes(cfg, 10, 300, 2) + job_need_bytes(cfg, 500, 20, 2)
    assert batch_need_bytes(cfg, [], [], 2) == 0
    with pytest.raises(ValueError):
        batch_need_bytes(cfg, [1], [1, 2], 2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("100", 100),
        (4096, 4096),
        ("512B", 512),
        ("1KB", 1000),
        ("1kib", 1024),
        ("512MiB", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("16GB", 16 * 10**9),
        ("1.5GiB", 3 * 2**29),
        (" 2 TiB ", 2 * 2**40),
        ("3TB", 3 * 10**12),
        ("80gib", 80 * 2**30),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "12 XB", "-5", "1.2.3", "GiB", "5 M B", "1e9", -1, True, 2.5]
)
def test_parse_size_refuses_with_a_clear_error(text: object) -> None:
    with pytest.raises(InvalidSize) as info:
        parse_size(text)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ConfigurationError)


def test_parse_size_error_lists_the_units() -> None:
    with pytest.raises(ConfigurationError, match="MiB"):
        parse_size("12 XB")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (512 * 2**20, "512 MiB"),
        (3 * 2**29, "1.5 GiB"),
        (80 * 2**30, "80 GiB"),
        (2**41, "2 TiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_reads_back_close(n: int) -> None:
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(1, n) * 0.05
