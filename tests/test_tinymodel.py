"""The tiny model loads offline like any HuggingFace model and is written deterministically."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.tinymodel import CONTEXT_LENGTH, write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loads_with_auto_classes(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.max_position_embeddings == CONTEXT_LENGTH
    assert cfg.vocab_size == len(tokenizer)
    assert 512 <= len(tokenizer) <= 1000
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<s>", "</s>", "<pad>")
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    "text",
    [
        "Hello world!",
        "The worker admits a job only when a slot is free.",
        "ünïcödé, emoji 🚀 and\ttabs\nnewlines   spaces",
        "def run(jobs): return [outcome for job in jobs]",
    ],
)
def test_tokenizer_round_trips(tiny_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_generates_tokens(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    enc = tokenizer("Hello", return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape == (1, enc["input_ids"].shape[1] + 8)


def test_same_seed_same_files_and_fast(tiny_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    again = write_tiny_model(tmp_path / "again", seed=0)
    assert time.monotonic() - started < 5.0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(tiny_dir / name), name


def test_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert _sha256(other / "model.safetensors") != _sha256(tiny_dir / "model.safetensors")
    assert _sha256(other / "tokenizer.json") == _sha256(tiny_dir / "tokenizer.json")


def test_accepts_str_path_and_existing_dir(tmp_path: Path) -> None:
    path = write_tiny_model(str(tmp_path), seed=3)
    assert path == tmp_path
    assert (path / "config.json").is_file()
