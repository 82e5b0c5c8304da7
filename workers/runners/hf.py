"""The HuggingFace runner: jobs on a local causal LM through transformers' continuous batching.

A job's life:

* ``submit`` encodes the prompt (chat ``messages`` through the tokenizer's chat template when it
  has one, else ``spec.text``), refuses what cannot fit the model's context, and adds one request
  to the engine (``workers.runners.engine``): the request joins the running batch at the next
  step and leaves it when done, so short jobs never wait for long ones.
* One collector thread reads every output of the engine and routes it by request id. It also
  watches deadlines (``max_runtime``, or the runner's ``default_max_runtime``: status
  ``timeout``), warns about jobs slower than ``slow_after``, and watches the generation loop.
* A cancelled job (``job.cancel`` calls our ``on_cancel``) is withdrawn from the engine and ends
  at once with status ``cancelled``; the engine emits nothing more for it, so timeouts and
  cancellations end from the tokens already streamed. Stop strings end a job ``succeeded`` with
  the output cut before the stop string.
* Every request streams (one output per decoding step): that gives ``progress`` (the lease
  renewal reads it) and the partial output of a cancelled or timed-out job for almost nothing
  (measured on the tiny model: within noise of not streaming). Text is decoded per step only for
  jobs with stop strings; streaming jobs get token ids in ``partial_ids``, decoded by the worker.
* If the generation loop dies (a request larger than the whole cache, out of device memory, any
  exception), every job it held ends ``failed`` with ``release=True`` (the worker gives it back
  to the queue), and a new engine is built; jobs submitted meanwhile wait for it.

What the engine cannot serve (a seeded sampled job, a job with ``min_new_tokens``) runs alone
through plain ``generate`` on a thread of its own, one job at a time; on that path ``ignore_eos``
suppresses end-of-sequence (as ``min_new_tokens=max_new_tokens`` does).

``Outcome.extra``: prompt_tokens, output_tokens, ttft_s, total_s and finish_reason ("stop": end
of sequence or a stop string; "length": ``max_new_tokens``; None when cancelled, timed out or
failed).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers import kvcache
from workers.runners.base import Done, Outcome, RunningJob
from workers.runners.engine import Engine, EngineConfig, EngineOutput, Sampling, generate_alone
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
#: How long the collector waits for an output before it looks at clocks and the loop's health.
_POLL_S = 0.02
_CLOCK_S = 0.05
#: Default tokens per engine step: small on the CPU (each step is slow), larger on a GPU.
_BATCH_TOKENS = {"cpu": 256, "cuda": 2048}


@dataclass(eq=False)
class _Flight:
    """One job inside the runner, from ``submit`` to its outcome."""

    job: RunningJob
    ids: list[int]
    started: float
    deadline: float | None
    runtime: float | None
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    warned_slow: bool = False


class HFRunner:
    """Runs jobs on a local HuggingFace causal LM (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        pages: int,
        page_tokens: int = 32,
        max_batch_tokens: int | None = None,
        max_requests: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
        slow_after: float = 30.0,
        default_max_runtime: float | None = None,
        loaded: tuple[Any, Any] | None = None,
    ) -> None:
        """``pages`` of ``page_tokens`` positions make the cache (``workers.kvcache.size_cache``
        chooses them); ``loaded`` = (tokenizer, model) already in memory, else both are loaded
        from ``model_dir``, offline."""
        if pages < 1 or page_tokens < 1:
            raise ConfigurationError(f"the cache needs pages >= 1 and page_tokens >= 1, not {pages}")
        self.path = Path(model_dir).expanduser()
        self.name = str(self.path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.slow_after = slow_after
        self.default_max_runtime = default_max_runtime
        if loaded is None:
            loaded = load(self.path, self.device, self.dtype)
        self._tokenizer, self._model = _prepare_tokenizer(loaded[0], self.path), loaded[1]
        self._eos = sorted(_eos_ids(self._model, self._tokenizer))
        batch_tokens = max_batch_tokens or _BATCH_TOKENS.get(self.device.type, 256)
        self.engine_config = EngineConfig(pages, page_tokens, batch_tokens, max_requests)
        self._tok_lock = threading.Lock()  # a Rust tokenizer must not be used by two threads
        self._encoded = functools.lru_cache(maxsize=1024)(self._encode_uncached)
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._backlog: list[_Flight] = []
        self._engine: Engine | None = None
        self._done: Done | None = None
        self._closing = threading.Event()
        self._collector: threading.Thread | None = None
        self._alone = ThreadPoolExecutor(1, thread_name_prefix="zkq-hf-alone")
        self._ids = itertools.count()

    # -- what the worker reads ----------------------------------------------------------------

    @property
    def page_tokens(self) -> int:
        return self.engine_config.page_tokens

    @property
    def cache_pages(self) -> int:
        return self.engine_config.pages

    @property
    def config(self) -> Any:
        return self._model.config

    @property
    def context_length(self) -> int:
        """Positions the model can attend to: prompt plus new tokens must fit."""
        length = getattr(kvcache.text_config(self._model.config), "max_position_embeddings", None)
        return int(length or self._tokenizer.model_max_length)

    @property
    def dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the resident parameters and buffers (shared tensors counted once)."""
        tensors = {id(t): t for t in [*self._model.parameters(), *self._model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def describe(self) -> dict[str, Any]:
        cfg = self.engine_config
        page_bytes = kvcache.bytes_per_page(self.config, self.dtype_bytes, cfg.page_tokens)
        return {
            "runner": "hf",
            "model": self.name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "weight_bytes": self.weight_bytes,
            "context_length": self.context_length,
            "cache": {
                "pages_total": cfg.pages,
                "page_tokens": cfg.page_tokens,
                "bytes_per_page": page_bytes,
                "max_batch_tokens": cfg.max_batch_tokens,
            },
        }

    def count_tokens(self, spec: JobSpec) -> int:
        """Tokens the job's prompt takes, exactly as ``submit`` encodes it (cached per prompt)."""
        return len(self._encode(spec))

    def validate(self, spec: JobSpec) -> str | None:
        """Why this job can never run on this model, or None."""
        try:
            prompt = self.count_tokens(spec)
        except Exception as exc:
            return f"cannot tokenize the prompt: {exc}"
        return self._context_error(prompt, spec.max_new_tokens)

    def pages_in_use(self) -> int | None:
        engine = self._engine
        return None if engine is None else engine.pages_in_use()

    # -- serving ------------------------------------------------------------------------------

    def start(self, done: Done) -> None:
        """Build the engine (allocating its cache) and the collector thread."""
        self._done = done
        self._engine = self._build_engine()
        self._collector = threading.Thread(target=self._collect, name="zkq-hf-collector")
        self._collector.daemon = True
        self._collector.start()

    def submit(self, job: RunningJob) -> None:
        job.decode = self._decode
        try:
            ids = self._encode(job.spec)
        except Exception as exc:  # one unencodable prompt must not reach the engine
            self._finish(job, Outcome(result.FAILED, error=f"cannot tokenize the prompt: {exc}"))
            return
        problem = self._context_error(len(ids), job.spec.max_new_tokens)
        if problem is not None:
            self._finish(job, Outcome(result.FAILED, error=problem))
            return
        runtime = job.spec.max_runtime or self.default_max_runtime
        now = time.monotonic()
        flight = _Flight(job, ids, now, now + runtime if runtime else None, runtime)
        if _needs_alone(job.spec):
            self._alone.submit(self._run_alone, flight)
            return
        flight.rid = f"{job.id}#{next(self._ids)}"
        job.on_cancel = lambda _job, rid=flight.rid: self._withdraw(rid, result.CANCELLED)
        with self._lock:
            self._flights[flight.rid] = flight
            if self._engine is None:
                self._backlog.append(flight)
            else:
                self._add(self._engine, flight)
        if job.cancelled.is_set():  # cancelled before the hook was set
            self._withdraw(flight.rid, result.CANCELLED)

    def close(self) -> None:
        """Stop the engine, end what it still held (released), and drop the model."""
        self._closing.set()
        if self._collector is not None:
            self._collector.join(timeout=10)
        self._alone.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            engine, self._engine = self._engine, None
            victims = list(self._flights.values())
            self._flights.clear()
        if engine is not None:
            engine.stop()
        for flight in victims:
            self._end(flight, result.FAILED, error="the runner was closed", release=True)
        self._model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the engine side ----------------------------------------------------------------------

    def _build_engine(self) -> Engine:
        engine = Engine(self._model, self.engine_config, self._eos)
        try:
            engine.start()
        except (MemoryError, ValueError, RuntimeError) as exc:
            engine.stop()
            raise ConfigurationError(f"the engine cannot allocate its cache: {exc}") from exc
        return engine

    def _add(self, engine: Engine, flight: _Flight) -> None:
        spec = flight.job.spec
        engine.add(
            flight.rid,
            flight.ids,
            max_new_tokens=spec.max_new_tokens,
            sampling=_sampling(spec),
            stop_at_eos=not spec.ignore_eos,
            stream=True,
        )  # refused (False) only by a dead loop: the collector ends the job with the others

    def _collect(self) -> None:
        next_clock = 0.0
        while not self._closing.is_set():
            engine = self._engine
            if engine is None:
                self._rebuild()
                continue
            out = engine.next_output(_POLL_S)
            if out is not None:
                self._route(out)
            now = time.monotonic()
            if now >= next_clock:
                next_clock = now + _CLOCK_S
                self._watch_clocks(now)
            if out is None and not engine.alive() and not self._closing.is_set():
                self._engine_died(engine)

    def _route(self, out: EngineOutput) -> None:
        flight = self._flights.get(out.request_id)
        if flight is None:  # already ended (cancelled, timed out, stopped)
            return
        if out.failed:
            error = f"the engine failed this job: {out.error}"
            self._withdraw(out.request_id, result.FAILED, error=error, release=True)
            return
        job, flight.tokens = flight.job, out.tokens
        if flight.ttft_s is None:
            flight.ttft_s = out.ttft_s
        job.progress = len(out.tokens)
        if job.spec.stream:
            job.partial_ids.extend(out.tokens[len(job.partial_ids) :])
        cut = self._stop_cut(flight)
        if cut is not None:
            self._withdraw(out.request_id, result.SUCCEEDED, text=cut, reason="stop")
        elif out.finished and self._pop(out.request_id):
            tokens, reason = self._trim(out.tokens, job.spec)
            self._end(flight, result.SUCCEEDED, tokens=tokens, reason=reason)

    def _watch_clocks(self, now: float) -> None:
        for flight in list(self._flights.values()):
            if flight.deadline is not None and now >= flight.deadline:
                error = f"max_runtime of {flight.runtime:g} s reached after {len(flight.tokens)} tokens"
                self._withdraw(flight.rid, result.TIMEOUT, error=error)
            elif not flight.warned_slow and now - flight.started > self.slow_after:
                flight.warned_slow = True
                log.warning(
                    "job %s has been running for %.1f s (prompt %d tokens, %d generated)",
                    flight.job.id,
                    now - flight.started,
                    len(flight.ids),
                    len(flight.tokens),
                )

    def _engine_died(self, engine: Engine) -> None:
        why = engine.failure() or "the generation loop stopped"
        log.error("the engine's generation loop died (%s); rebuilding it", why)
        with self._lock:
            self._engine = None
            victims = [f for f in self._flights.values() if f not in self._backlog]
            for flight in victims:
                del self._flights[flight.rid]
        for flight in victims:
            self._end(flight, result.FAILED, error=f"the engine failed: {why}", release=True)
        engine.stop()

    def _rebuild(self) -> None:
        try:
            engine = self._build_engine()
        except Exception:
            log.exception("cannot rebuild the engine; giving its jobs back and trying again")
            with self._lock:
                waiting, self._backlog = self._backlog, []
                for flight in waiting:
                    self._flights.pop(flight.rid, None)
            for flight in waiting:
                self._end(flight, result.FAILED, error="the engine is down", release=True)
            self._closing.wait(5.0)
            return
        with self._lock:
            self._engine = engine
            waiting, self._backlog = self._backlog, []
            for flight in waiting:
                if flight.rid in self._flights:
                    self._add(engine, flight)

    # -- ending jobs --------------------------------------------------------------------------

    def _pop(self, rid: str) -> _Flight | None:
        """Take a flight out of the table: whoever gets it reports its outcome, exactly once."""
        with self._lock:
            flight = self._flights.pop(rid, None)
            if flight is not None and flight in self._backlog:
                self._backlog.remove(flight)
            return flight

    def _withdraw(self, rid: str, status: str, **how: Any) -> None:
        """End a job before the engine finished it (cancel, timeout, stop string, failure)."""
        flight = self._pop(rid)
        if flight is None:
            return
        engine = self._engine
        if engine is not None and status != result.FAILED:
            engine.cancel(rid)
        if status == result.CANCELLED:
            why = flight.job.cancel_reason or "cancelled"
            how["error"] = f"job was {why} after {len(flight.tokens)} tokens"
        self._end(flight, status, **how)

    def _end(
        self,
        flight: _Flight,
        status: str,
        *,
        tokens: list[int] | None = None,
        text: str | None = None,
        reason: str | None = None,
        error: str | None = None,
        release: bool = False,
    ) -> None:
        tokens = flight.tokens if tokens is None else tokens
        if text is None:
            text = self._decode(tokens) if tokens else ""
        flight.job.progress = len(tokens)
        extra = {
            "prompt_tokens": len(flight.ids),
            "output_tokens": len(tokens),
            "ttft_s": None if flight.ttft_s is None else round(flight.ttft_s, 6),
            "total_s": round(time.monotonic() - flight.started, 6),
            "finish_reason": reason,
        }
        self._finish(flight.job, Outcome(status, text, error, extra, release))

    def _finish(self, job: RunningJob, outcome: Outcome) -> None:
        assert self._done is not None, "start() the runner first"
        try:
            self._done(job, outcome)
        except Exception:  # the worker's trouble must not kill the collector
            log.exception("job %s: reporting its outcome failed", job.id)

    def _trim(self, tokens: list[int], spec: JobSpec) -> tuple[list[int], str]:
        """The tokens before the first end of sequence, and why generation stopped."""
        if not spec.ignore_eos:
            for i, token in enumerate(tokens):
                if token in self._eos:
                    return tokens[:i], "stop"
        return tokens, "length"

    def _stop_cut(self, flight: _Flight) -> str | None:
        """The output before the first stop string, once one appeared; None until then. Only a
        tail is decoded per step (a token is at most 4 bytes of a character)."""
        stops = flight.job.spec.stop
        if not stops:
            return None
        tokens, _ = self._trim(flight.tokens, flight.job.spec)
        tail = self._decode(tokens[-(4 * max(map(len, stops)) + 4) :])
        if not any(stop in tail for stop in stops):
            return None
        text = self._decode(tokens)
        found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        return text[: min(found)] if found else None

    # -- the path for what the engine cannot serve -------------------------------------------

    def _run_alone(self, flight: _Flight) -> None:
        job, spec = flight.job, flight.job.spec
        sampling = _sampling(spec)
        ended: list[str] = []

        def on_step(tokens: list[int]) -> bool:
            now = time.monotonic()
            flight.tokens, job.progress = tokens, len(tokens)
            if flight.ttft_s is None:
                flight.ttft_s = now - flight.started
            if spec.stream:
                job.partial_ids.extend(tokens[len(job.partial_ids) :])
            if job.cancelled.is_set():
                ended.append(result.CANCELLED)
            elif flight.deadline is not None and now >= flight.deadline:
                ended.append(result.TIMEOUT)
            return bool(ended) or self._stop_cut(flight) is not None

        seeded = sampling is not None and spec.seed is not None
        try:
            with self._exclusive(spec.seed if seeded else None):
                generate_alone(
                    self._model,
                    flight.ids,
                    max_new_tokens=spec.max_new_tokens,
                    min_new_tokens=spec.max_new_tokens if spec.ignore_eos else spec.min_new_tokens,
                    sampling=sampling,
                    eos_ids=self._eos,
                    pad_id=int(self._tokenizer.pad_token_id),
                    on_step=on_step,
                )
        except Exception as exc:
            log.exception("generate failed for job %s", job.id)
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            self._end(flight, result.FAILED, error=f"generation failed: {exc}", release=oom)
            return
        self._end_alone(flight, ended[0] if ended else None)

    def _end_alone(self, flight: _Flight, ended: str | None) -> None:
        n = len(flight.tokens)
        if ended == result.CANCELLED:
            why = flight.job.cancel_reason or "cancelled"
            self._end(flight, ended, error=f"job was {why} after {n} tokens")
        elif ended == result.TIMEOUT:
            error = f"max_runtime of {flight.runtime:g} s reached after {n} tokens"
            self._end(flight, ended, error=error)
        elif (cut := self._stop_cut(flight)) is not None:
            self._end(flight, result.SUCCEEDED, text=cut, reason="stop")
        else:
            tokens, reason = self._trim(flight.tokens, flight.job.spec)
            self._end(flight, result.SUCCEEDED, tokens=tokens, reason=reason)

    @contextlib.contextmanager
    def _exclusive(self, seed: int | None) -> Iterator[None]:
        """For a seeded job: the engine parked (no other draw from the RNG) and the RNG forked."""
        engine = self._engine
        if seed is None or engine is None:
            yield
            return
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with engine.paused(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    # -- tokens -------------------------------------------------------------------------------

    def _encode(self, spec: JobSpec) -> list[int]:
        messages = None if spec.messages is None else tuple(tuple(m.items()) for m in spec.messages)
        return list(self._encoded(spec.prompt, messages))

    def _encode_uncached(self, prompt: str, messages: Any) -> tuple[int, ...]:
        with self._tok_lock:
            if messages is not None and getattr(self._tokenizer, "chat_template", None):
                chat = [dict(m) for m in messages]
                out = self._tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=True
                )
                ids = out["input_ids"] if hasattr(out, "keys") else out
            elif messages is not None:
                text = JobSpec(prompt="", messages=tuple(dict(m) for m in messages)).text
                ids = self._tokenizer(text)["input_ids"]
            else:
                ids = self._tokenizer(prompt)["input_ids"]
        return tuple(int(i) for i in ids)

    def _decode(self, tokens: list[int]) -> str:
        with self._tok_lock:
            return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

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


def load(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load tokenizer and model from a local directory only; ConfigurationError names it."""
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
    return _prepare_tokenizer(tokenizer, path), model


def _prepare_tokenizer(tokenizer: Any, path: Path) -> Any:
    """A pad token (eos if the model has none), for the plain ``generate`` path."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigurationError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token that ends a sequence: the generation config's (one or a list) and the
    tokenizer's."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


def _sampling(spec: JobSpec) -> Sampling | None:
    """The job's sampling knobs, or None for greedy decoding (no temperature nor top_p, or a
    temperature of 0)."""
    if spec.temperature == 0 or (spec.temperature is None and spec.top_p is None):
        return None
    temperature = 1.0 if spec.temperature is None else float(spec.temperature)
    return Sampling(temperature, 1.0 if spec.top_p is None else float(spec.top_p))


def _needs_alone(spec: JobSpec) -> bool:
    """Jobs the engine cannot serve: seeded sampling, and min_new_tokens (see engine.py)."""
    seeded = spec.seed is not None and _sampling(spec) is not None
    return seeded or (bool(spec.min_new_tokens) and not spec.ignore_eos)
