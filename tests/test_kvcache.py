"""Cache sizing in pages, the KV byte figures behind it, and the size syntax used by budgets."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import GPT2Config, LlamaConfig

from workers import kvcache
from workers.kvcache import (
    InvalidSize,
    activation_bytes,
    bytes_per_page,
    format_size,
    kv_cache_bytes,
    parse_size,
    read_bytes_per_token,
    size_cache,
    step_bytes,
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


def test_a_page_holds_page_tokens_positions_of_every_layer() -> None:
    cfg = llama_7b_like()
    assert bytes_per_page(cfg, 2, 32) == 32 * 131072  # 4 MiB
    assert bytes_per_page(cfg, 2, 1) == kv_cache_bytes(cfg, 1, 2)


def test_the_step_peak_is_the_larger_of_lm_head_and_attention() -> None:
    cfg = llama_7b_like()
    lm_head = 4096 * 2 + 32000 * 4
    attention = 2 * (4096 + 32 * 128 + 2 * 8 * 128 + (2 * 32 + 8) * 128)
    per_token = max(lm_head, attention) + 7 * 4 + 4 + 32 * 4 + 8 + 8
    flash = step_bytes(cfg, 2, 256, flash=True)
    assert flash == pytest.approx(256 * per_token * (1 + kvcache.OVERHEAD_FRACTION), abs=1)
    # Eager/SDPA add the M x M corner of the attention mask.
    assert step_bytes(cfg, 2, 256) > flash + 256 * 256 * 2


def test_cached_positions_add_their_read_back_and_mask_column() -> None:
    cfg = llama_7b_like()
    sdpa = read_bytes_per_token(cfg, 2, 2048)
    flash = read_bytes_per_token(cfg, 2, 2048, flash=True)
    assert flash < sdpa
    assert sdpa >= (2 * 32 + 8) * 128 * 2 + 8 + 2048 * 2
    cache_tokens = 10_000
    assert activation_bytes(cfg, 2, 2048, cache_tokens) == step_bytes(cfg, 2, 2048) + (
        cache_tokens * sdpa
    )


def test_size_cache_fills_the_budget_and_no_more() -> None:
    cfg = llama_7b_like()
    free, reserve = 40 * 2**30, 2 * 2**30
    plan = size_cache(
        cfg, 2, free_bytes=free, reserve_bytes=reserve, page_tokens=32, max_batch_tokens=2048
    )
    assert plan.page_tokens == 32 and plan.bytes_per_page == bytes_per_page(cfg, 2, 32)
    used = plan.cache_bytes + plan.activation_bytes
    assert used <= free - reserve
    # What is left would not pay for the spare pages plus one more.
    per_page = plan.bytes_per_page + 32 * read_bytes_per_token(cfg, 2, 2048)
    assert free - reserve - used < (kvcache.SPARE_PAGES + 1) * per_page
    assert 7000 < plan.pages < 9000  # ~34 GiB of 4 MiB pages, less the step's peak


def test_flash_attention_and_a_smaller_step_leave_more_pages() -> None:
    cfg = llama_7b_like()
    sized = functools.partial(size_cache, cfg, 2, free_bytes=20 * 2**30, page_tokens=32)
    sdpa = sized(max_batch_tokens=2048).pages
    assert sized(max_batch_tokens=2048, flash=True).pages > sdpa
    assert sized(max_batch_tokens=256).pages > sdpa


def test_no_room_means_no_pages() -> None:
    cfg = llama_7b_like()
    assert size_cache(cfg, 2, free_bytes=2**30, reserve_bytes=2**31).pages == 0
    assert size_cache(cfg, 2, free_bytes=10 * 2**20, max_batch_tokens=2048).pages == 0


def test_bad_page_shape_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        size_cache(llama_7b_like(), 2, free_bytes=2**30, page_tokens=0)


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
