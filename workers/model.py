"""Load a model worker's model and build its runner and admission from one ``WorkerOptions``.

``build_model_runner`` loads the tokenizer and weights (offline, from a local directory), reads
the memory that is left (``workers.memory.make_probe``: a static budget, NVML, torch or
/proc/meminfo), sizes the KV cache in pages from it (``workers.kvcache.size_cache``), and returns
the runner with an ``Admission`` that counts those pages. The worker's slots cap the jobs it
holds: ``--max-concurrency``, else the engine's throughput knee (``workers.calibration``: measured
at start, or cached, or a per-device rule). The engine takes as many requests into one step as
the worker has slots, so an admitted job never waits inside the engine, where priority no longer
applies.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers import kvcache
from workers.admission import Admission
from workers.calibration import admission_slots
from workers.memory import make_probe
from workers.options import MODEL_SLOTS, WorkerOptions
from workers.runners.codec import eos_ids
from workers.runners.engine import EngineConfig
from workers.runners.hf import HFRunner
from zkqueue.errors import ConfigurationError

log = logging.getLogger("zkq.worker")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
#: Positions per KV-cache page. Admission rounds each job up to whole pages, so small pages waste
#: little (16 positions per job on average) while keeping the engine's page tables short.
PAGE_TOKENS = 32
#: Tokens per engine step: small on the CPU, where a step is slow, larger on a GPU for prefill.
BATCH_TOKENS = {"cpu": 256, "cuda": 2048}


def build_model_runner(opts: WorkerOptions) -> tuple[HFRunner, Admission]:
    """The runner for ``opts.model`` with a cache sized from the memory left, and its admission.
    ``opts.greedy_only`` builds a greedy-only engine (see ``workers.runners.engine`` for the
    cost of sampling). Raises ConfigurationError when the model cannot be loaded or no page
    fits."""
    if not opts.model:
        raise ConfigurationError("a model worker needs a model directory (--model)")
    path = Path(opts.model).expanduser()
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    tokenizer, model = load(path, device, dtype)
    pages, batch_tokens = size_for(model, opts)
    engine = EngineConfig(pages, PAGE_TOKENS, batch_tokens)
    eos = sorted(eos_ids(model, tokenizer))
    slots = admission_slots(opts, model, eos, engine, sampling=not opts.greedy_only)
    log.info("admission: %s", slots.text())
    runner = HFRunner(
        tokenizer,
        model,
        name=str(path),
        pages=pages,
        page_tokens=PAGE_TOKENS,
        max_batch_tokens=batch_tokens,
        max_requests=slots.count,
        slots=slots,
        slow_after=opts.slow_after,
        default_max_runtime=opts.max_runtime,
        sampling=not opts.greedy_only,
    )
    admission = Admission(
        pages,
        PAGE_TOKENS,
        count_tokens=runner.count_tokens,
        validate=runner.validate,
        pages_in_use=runner.pages_in_use,
    )
    return runner, admission


def size_for(model: Any, opts: WorkerOptions) -> tuple[int, int]:
    """(pages, max_batch_tokens) for ``model`` as loaded, from the memory the probe sees."""
    weights = weight_bytes(model)
    probe = make_probe(str(model.device), opts.vram_budget, weights)
    try:
        snapshot = probe.snapshot()
    finally:
        probe.close()
    batch_tokens = BATCH_TOKENS.get(model.device.type, BATCH_TOKENS["cpu"])
    flash = "flash" in str(getattr(model.config, "_attn_implementation", ""))
    dtype_bytes = torch.tensor([], dtype=model.dtype).element_size()
    plan = kvcache.size_cache(
        model.config,
        dtype_bytes,
        free_bytes=snapshot.free,
        reserve_bytes=opts.vram_reserve,
        page_tokens=PAGE_TOKENS,
        max_batch_tokens=batch_tokens,
        flash=flash,
    )
    fmt = kvcache.format_size
    useful = most_useful_pages(model, opts)
    pages = plan.pages if useful is None else min(plan.pages, useful)
    if plan.pages < 1:
        raise ConfigurationError(
            f"no KV-cache page fits: {fmt(snapshot.free)} free after the weights "
            f"({fmt(weights)}, {snapshot.source} probe), minus the reserve "
            f"({fmt(opts.vram_reserve)}) and the largest step "
            f"({fmt(plan.activation_bytes)}), leaves less than one page of "
            f"{fmt(plan.bytes_per_page)}"
        )
    # The step peak of the cache actually made (the plan's is for every page that would fit).
    peak = kvcache.activation_bytes(
        model.config, dtype_bytes, batch_tokens, pages * plan.page_tokens, flash
    )
    log.info(
        "KV cache: %d pages of %d tokens (%s) from %s free (%s); step peak ~%s%s",
        pages,
        plan.page_tokens,
        fmt(pages * plan.bytes_per_page),
        fmt(snapshot.free),
        snapshot.source,
        fmt(peak),
        "" if pages == plan.pages else f"; {plan.pages} would fit, {pages} can ever be used",
    )
    return pages, batch_tokens


def most_useful_pages(model: Any, opts: WorkerOptions) -> int | None:
    """The most pages the worker's jobs could ever hold at once: every slot at the full context.
    A larger cache is memory nobody can use (on a CPU host without a budget, the free RAM would
    otherwise all go to the cache). None when the model states no context length."""
    context = getattr(kvcache.text_config(model.config), "max_position_embeddings", None)
    if not context:
        return None
    slots = opts.max_concurrency or MODEL_SLOTS
    return slots * math.ceil(int(context) / PAGE_TOKENS) + kvcache.SPARE_PAGES


def weight_bytes(model: Any) -> int:
    """Bytes of the resident parameters and buffers (shared tensors counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigurationError(f"bad device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"device {device!r} was asked for but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA devices that support it, float16 on other CUDA devices and
    float32 on the CPU."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ConfigurationError(f"unknown dtype {dtype!r} (use auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(tokenizer, model) from a local directory only; ConfigurationError names it."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigurationError(f"model directory {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigurationError(f"{path} is not a model directory: it has no config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        model = model.to(device).eval()
    except Exception as exc:
        raise ConfigurationError(f"cannot load a causal language model from {path}: {exc}") from exc
    if tokenizer.pad_token is None:  # the plain generate path pads
        if tokenizer.eos_token is None:
            raise ConfigurationError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model
