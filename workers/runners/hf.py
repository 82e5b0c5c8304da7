"""The HuggingFace runner: batched ``model.generate`` over a local causal language model.

How a batch is run:

* Each prompt is tokenized alone. One whose tokens plus ``max_new_tokens`` exceed the model's
  context fails with the numbers (never truncated); one already cancelled is answered at once.
* Greedy jobs (no temperature, temperature 0, or only a seed) run together in one ``generate``
  call, left-padded with an explicit attention mask, for the batch's largest ``max_new_tokens``.
  A stopping criterion returns a per-row verdict each step: a row stops at its own
  ``max_new_tokens``, its first eos, its cancellation or its ``max_runtime`` deadline. Each row's
  output is then cut to what it generated before it stopped and before its first eos. Greedy rows
  give the same tokens batched as alone.
* Sampling jobs (temperature > 0 or top_p set) cannot share a call with greedy ones, since
  ``generate`` takes one sampling setting per call: unseeded ones are batched by equal
  (temperature, top_p); a seeded one runs alone under ``torch.manual_seed(seed)`` (in a forked RNG
  state, under a process-wide lock) so the same seed gives the same text. A seed without sampling
  parameters changes nothing: greedy decoding is already reproducible. Sampling applies exactly the
  job's temperature and top_p (top_k is off).
* Batches are also split at ``max_batch`` rows and so that the longest prompt plus the largest
  ``max_new_tokens`` fits the context; they run in the order of their first job.
* ``max_runtime`` counts from the start of the job's own ``generate`` call.

``Outcome.extra`` holds prompt_tokens, output_tokens, ttft_s (from the call's start to its first
decoding step, as the stopping criterion first sees it) and total_s (to the row's stop).
``progress`` on each job is its token count, updated every step.

A CUDA out-of-memory error frees the cache and raises ``BatchOutOfMemory`` (which carries the
outcomes already finished); the worker owns the retry with smaller batches. Any other error in
``generate`` fails that call's jobs with the message and does not raise.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from workers import kvcache
from workers.runners.base import Outcome, OutOfMemory, RunningJob
from zkqueue import result
from zkqueue.errors import ConfigurationError
from zkqueue.spec import JobSpec

log = logging.getLogger("zkq.runner")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
#: torch's global RNG is process-wide: seeded generations take turns.
_SEED_LOCK = threading.Lock()


class BatchOutOfMemory(OutOfMemory):
    """The device ran out of memory during ``generate``; the cache was freed before raising."""


@dataclass
class _Row:
    """One job inside a ``generate`` call and how it ended."""

    index: int
    job: RunningJob
    ids: list[int]
    runtime: float | None = None
    deadline: float | None = None
    reason: str | None = None  # eos, length, cancelled, timeout
    generated: int = 0
    stopped_at: float | None = None
    warned_slow: bool = False

    @property
    def max_new(self) -> int:
        return self.job.spec.max_new_tokens


class _RowStopper(StoppingCriteria):
    """Per-row stop verdicts, progress and slow-job warnings, evaluated once per decoding step."""

    def __init__(
        self, rows: list[_Row], width: int, eos: set[int], started: float, slow_after: float
    ) -> None:
        self.rows, self.width, self.eos = rows, width, eos
        self.started, self.slow_after = started, slow_after
        self.first_token_at: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        generated = input_ids.shape[1] - self.width
        last = input_ids[:, -1].tolist()
        for row, token in zip(self.rows, last, strict=True):
            if row.reason is None:
                self._step(row, token, generated, now)
            self._warn_if_slow(row, now)
        done = [row.reason is not None for row in self.rows]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    def _step(self, row: _Row, token: int, generated: int, now: float) -> None:
        row.generated = min(generated, row.max_new)
        row.job.progress = row.generated
        if row.job.spec.stream and token not in self.eos:
            row.job.partial_ids.append(token)
        if token in self.eos:
            row.reason = "eos"
        elif generated >= row.max_new:
            row.reason = "length"
        elif row.job.cancelled.is_set():
            row.reason = "cancelled"
        elif row.deadline is not None and now >= row.deadline:
            row.reason = "timeout"
        if row.reason is not None:
            row.stopped_at = now

    def _warn_if_slow(self, row: _Row, now: float) -> None:
        elapsed = (row.stopped_at or now) - self.started
        if not row.warned_slow and elapsed > self.slow_after:
            row.warned_slow = True
            log.warning(
                "job %s has been running for %.1f s (prompt %d tokens, %d generated)",
                row.job.id,
                elapsed,
                len(row.ids),
                row.generated,
            )


class HFRunner:
    """Runs jobs on a local HuggingFace causal LM (see the module docstring for the batching)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch: int = 8,
        slow_after: float = 30.0,
        default_max_runtime: float | None = None,
        loaded: tuple[Any, Any] | None = None,
    ) -> None:
        """``loaded`` = (tokenizer, model) already in memory (checks that build a model on the
        device directly); otherwise both are loaded from ``model_dir``, offline."""
        if max_batch < 1:
            raise ConfigurationError(f"max_batch must be at least 1, not {max_batch}")
        self.path = Path(model_dir).expanduser()
        self.name = str(self.path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch = max_batch
        self.slow_after = slow_after
        self.default_max_runtime = default_max_runtime
        self._lock = threading.Lock()  # one run at a time
        self._tok_lock = threading.Lock()  # a Rust tokenizer must not be used by two threads
        if loaded is None:
            self._tokenizer, self._model = _load(self.path, self.device, self.dtype)
        else:
            self._tokenizer, self._model = _prepare_tokenizer(loaded[0], self.path), loaded[1]
        self._eos = _eos_ids(self._model, self._tokenizer)
        # The head prices a growing batch once per candidate: count each prompt's tokens once.
        self._token_counts = functools.lru_cache(maxsize=256)(self._count_uncached)

    # -- what the worker reads ----------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The model's transformers config (for ``workers.kvcache``)."""
        return self._model.config

    @property
    def context_length(self) -> int:
        """Positions the model can attend to: prompt plus new tokens must fit."""
        cfg = kvcache.text_config(self._model.config)
        length = getattr(cfg, "max_position_embeddings", None)
        return int(length or self._tokenizer.model_max_length)

    @property
    def dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the resident parameters and buffers (shared tensors counted once)."""
        tensors = list(self._model.parameters()) + list(self._model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "device": str(self.device),
            "dtype": _dtype_name(self.dtype),
            "dtype_bytes": self.dtype_bytes,
            "weight_bytes": self.weight_bytes,
            "max_batch": self.max_batch,
            "context_length": self.context_length,
        }

    def count_tokens(self, prompt: str) -> int:
        """Tokens the prompt takes, special tokens included, exactly as ``run`` encodes it."""
        return int(self._token_counts(prompt))

    def _count_uncached(self, prompt: str) -> int:
        return len(self._encode(prompt))

    def validate(self, spec: JobSpec) -> str | None:
        """Why this job can never run on this model (prompt + max_new_tokens over the context)."""
        return self._context_error(self.count_tokens(spec.prompt), spec.max_new_tokens)

    def batch_need_bytes(self, specs: Sequence[JobSpec]) -> int:
        """Estimated device bytes of running ``specs`` as one batch (rows padded to the longest)."""
        if not specs:
            return 0
        return kvcache.batch_need_bytes(
            self.config,
            [self.count_tokens(s.prompt) for s in specs],
            [s.max_new_tokens for s in specs],
            self.dtype_bytes,
        )

    def need_bytes(self, spec: JobSpec) -> int:
        """Estimated device bytes the job adds to the resident weights (KV cache + activations)."""
        return self.batch_need_bytes([spec])

    # -- running ------------------------------------------------------------------------------

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        """Run ``jobs``; one outcome per job, in order. Raises only ``BatchOutOfMemory``."""
        with self._lock, torch.inference_mode():
            outcomes: list[Outcome | None] = [None] * len(jobs)
            rows = self._admit(jobs, outcomes)
            for batch in self._plan(rows):
                self._run_batch(batch, outcomes)
            return [o or Outcome(result.FAILED, error="not run") for o in outcomes]

    def close(self) -> None:
        """Drop the model and tokenizer and return the device memory."""
        with self._lock:
            self._model = None
            self._tokenizer = None
            _free_memory(self.device)

    def _admit(self, jobs: list[RunningJob], outcomes: list[Outcome | None]) -> list[_Row]:
        """Tokenize; answer at once the jobs that are cancelled or cannot fit the context."""
        rows = []
        for index, job in enumerate(jobs):
            try:
                ids = self._encode(job.spec.prompt)
            except Exception as exc:  # one unencodable prompt must not sink the batch
                outcomes[index] = Outcome(result.FAILED, error=f"cannot tokenize the prompt: {exc}")
                continue
            error = self._context_error(len(ids), job.spec.max_new_tokens)
            if job.cancelled.is_set():
                outcomes[index] = _outcome(_Row(index, job, ids, reason="cancelled"), "", 0.0, None)
            elif error is not None:
                outcomes[index] = Outcome(
                    result.FAILED, error=error, extra={"prompt_tokens": len(ids)}
                )
            else:
                rows.append(_Row(index, job, ids))
        return rows

    def _context_error(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        if prompt_tokens == 0:
            return "the prompt encodes to no tokens"
        limit = self.context_length
        if prompt_tokens + max_new_tokens > limit:
            return (
                f"prompt is {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model context of {limit} tokens (at most "
                f"{max(0, limit - max_new_tokens)} prompt tokens for this max_new_tokens)"
            )
        return None

    def _plan(self, rows: list[_Row]) -> list[list[_Row]]:
        """Group rows that can share a ``generate`` call, in the order of their first job."""
        groups: dict[Any, list[_Row]] = {}
        for row in rows:
            groups.setdefault(_group_key(row), []).append(row)
        batches = [b for group in groups.values() for b in self._split(group)]
        return sorted(batches, key=lambda batch: batch[0].index)

    def _split(self, rows: list[_Row]) -> list[list[_Row]]:
        batches: list[list[_Row]] = []
        for row in rows:
            current = batches[-1] if batches else None
            if current is not None and self._fits([*current, row]):
                current.append(row)
            else:
                batches.append([row])
        return batches

    def _fits(self, rows: list[_Row]) -> bool:
        if len(rows) > self.max_batch:
            return False
        longest = max(len(r.ids) for r in rows)
        return longest + max(r.max_new for r in rows) <= self.context_length

    def _run_batch(self, rows: list[_Row], outcomes: list[Outcome | None]) -> None:
        started = time.monotonic()
        width = max(len(r.ids) for r in rows)
        for row in rows:
            row.job.decode = self._decode
            row.runtime = row.job.spec.max_runtime or self.default_max_runtime
            row.deadline = started + row.runtime if row.runtime else None
        stopper = _RowStopper(rows, width, self._eos, started, self.slow_after)
        try:
            output = self._generate(rows, width, stopper)
        except torch.cuda.OutOfMemoryError as exc:
            message = f"out of device memory generating a batch of {len(rows)}: {exc}"
        except Exception as exc:
            log.exception("generate failed for jobs %s", ", ".join(r.job.id for r in rows))
            for row in rows:
                outcomes[row.index] = Outcome(
                    result.FAILED,
                    error=f"generation failed: {exc}",
                    extra={"prompt_tokens": len(row.ids)},
                )
            return
        else:
            self._collect(rows, output[:, width:].tolist(), stopper, started, outcomes)
            return
        # Out of the except block, so the traceback's frames (and their tensors) are gone.
        _free_memory(self.device)
        raise BatchOutOfMemory(message, outcomes, len(rows))

    def _generate(self, rows: list[_Row], width: int, stopper: _RowStopper) -> torch.Tensor:
        pad = int(self._tokenizer.pad_token_id)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.ids) :] = torch.tensor(row.ids)
            mask[i, width - len(row.ids) :] = 1
        spec = rows[0].job.spec
        sampling, seed = _sampling(spec)
        with _seeded(seed, self.device):
            return self._model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max(r.max_new for r in rows),
                pad_token_id=pad,
                eos_token_id=sorted(self._eos),
                stopping_criteria=StoppingCriteriaList([stopper]),
                **_sampling_kwargs(sampling),
            )

    def _collect(
        self,
        rows: list[_Row],
        generated: list[list[int]],
        stopper: _RowStopper,
        started: float,
        outcomes: list[Outcome | None],
    ) -> None:
        ttft = None if stopper.first_token_at is None else stopper.first_token_at - started
        ended = time.monotonic()
        for row, tokens in zip(rows, generated, strict=True):
            kept = self._trim(tokens[: row.generated or len(tokens)])
            row.generated = len(kept)
            row.job.progress = len(kept)
            text = self._decode(kept)
            outcomes[row.index] = _outcome(row, text, (row.stopped_at or ended) - started, ttft)

    def _trim(self, tokens: list[int]) -> list[int]:
        """The tokens before the first eos."""
        for i, token in enumerate(tokens):
            if token in self._eos:
                return tokens[:i]
        return tokens

    def _encode(self, prompt: str) -> list[int]:
        with self._tok_lock:
            return list(self._tokenizer(prompt)["input_ids"])

    def _decode(self, tokens: list[int]) -> str:
        with self._tok_lock:
            return str(self._tokenizer.decode(tokens, skip_special_tokens=True))


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


def _load(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load tokenizer and model from a local directory only; ConfigurationError names it."""
    if not path.is_dir():
        raise ConfigurationError(f"model directory {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigurationError(f"{path} is not a model directory: it has no config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, **_dtype_kwarg(dtype)
        )
        model = model.to(device).eval()
    except Exception as exc:
        raise ConfigurationError(f"cannot load a causal language model from {path}: {exc}") from exc
    return _prepare_tokenizer(tokenizer, path), model


def _prepare_tokenizer(tokenizer: Any, path: Path) -> Any:
    """Left padding for batched generation, and a pad token (eos if the model has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigurationError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers 4.56 renamed ``torch_dtype`` to ``dtype``; older releases ignore ``dtype``."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token that ends a sequence: the generation config's (one or a list) and the
    tokenizer's."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


def _sampling(spec: JobSpec) -> tuple[tuple[float, float] | None, int | None]:
    """((temperature, top_p) or None for greedy, the seed where it matters)."""
    if spec.temperature == 0 or (spec.temperature is None and spec.top_p is None):
        return None, None
    temperature = 1.0 if spec.temperature is None else float(spec.temperature)
    top_p = 1.0 if spec.top_p is None else float(spec.top_p)
    return (temperature, top_p), spec.seed


def _group_key(row: _Row) -> Any:
    sampling, seed = _sampling(row.job.spec)
    return (sampling, row.index) if seed is not None else sampling


def _sampling_kwargs(sampling: tuple[float, float] | None) -> dict[str, Any]:
    if sampling is None:
        return {"do_sample": False}
    temperature, top_p = sampling
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed torch's RNG for one generation without disturbing anyone else's RNG state."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with _SEED_LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _outcome(row: _Row, text: str, total_s: float, ttft_s: float | None) -> Outcome:
    extra = {
        "prompt_tokens": len(row.ids),
        "output_tokens": row.generated,
        "ttft_s": None if ttft_s is None else round(ttft_s, 6),
        "total_s": round(total_s, 6),
    }
    if row.reason == "cancelled":
        why = row.job.cancel_reason or "cancelled"
        return Outcome(result.CANCELLED, text, f"job was {why} after {row.generated} tokens", extra)
    if row.reason == "timeout":
        error = f"max_runtime of {row.runtime:g} s reached after {row.generated} tokens"
        return Outcome(result.TIMEOUT, text, error, extra)
    return Outcome(result.SUCCEEDED, text, None, extra)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
