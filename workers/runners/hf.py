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
* A request streams (one output per decoding step) when its caller streams or it has stop
  strings; text is decoded per step only for stop strings, and streaming jobs get token ids in
  ``partial_ids``, decoded by the worker. The others do not stream (per-step outputs cost the
  engine's thread ~4% on the CPU): every clock tick the collector reads their tokens so far from
  the engine, which gives ``progress`` (the lease renewal reads it) and the partial output of a
  cancelled or timed-out job.
* If the generation loop dies (a request larger than the whole cache, out of device memory, any
  exception), every job it held ends ``failed`` with ``release=True`` (the worker gives it back
  to the queue), and a new engine is built; jobs submitted meanwhile wait for it.

What the engine cannot serve (a seeded sampled job, a job with ``min_new_tokens``, a sampled job
when the runner was built with ``sampling=False``) runs alone through plain ``generate`` on a
thread of its own, one job at a time (``workers.runners.flight.PlainPath``).

``Outcome.extra``: prompt_tokens, output_tokens, ttft_s, total_s, finish_reason ("stop": end
of sequence or a stop string; "length": ``max_new_tokens``; None when cancelled, timed out or
failed), and for a job that streams, first_token_at (unix seconds).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from workers import kvcache
from workers.calibration import Slots
from workers.runners.base import Done, Outcome, RunningJob
from workers.runners.codec import Codec, eos_ids
from workers.runners.engine import Engine, EngineConfig, EngineOutput
from workers.runners.flight import Flight, PlainPath, needs_alone, sampling_of, streams
from zkqueue.errors import ConfigurationError
from zkqueue.protocol import result
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.runner")

#: How long the collector waits for an output before it looks at clocks and the loop's health.
_POLL_S = 0.02
_CLOCK_S = 0.05


class HFRunner:
    """Runs jobs on a loaded HuggingFace causal LM (see the module docstring);
    ``workers.model.build_model_runner`` loads the model and sizes the cache."""

    def __init__(
        self,
        tokenizer: Any,
        model: Any,
        *,
        pages: int,
        page_tokens: int = 32,
        max_batch_tokens: int = 256,
        max_requests: int | None = None,
        name: str = "hf",
        slow_after: float = 30.0,
        default_max_runtime: float | None = None,
        sampling: bool = True,
        slots: Slots | None = None,
    ) -> None:
        """``pages`` of ``page_tokens`` positions make the cache; ``sampling=False`` builds a
        greedy-only engine (faster per step; sampled jobs then run alone, see
        ``workers.runners.engine``); ``slots``: the worker's slots and how they were found."""
        if pages < 1 or page_tokens < 1:
            raise ConfigurationError(
                f"the cache needs pages >= 1 and page_tokens >= 1, not {pages}"
            )
        self.name = name
        self.slow_after = slow_after
        self.default_max_runtime = default_max_runtime
        self.sampling = sampling
        self.slots = slots
        self._model = model
        self._eos = sorted(eos_ids(model, tokenizer))
        length = getattr(kvcache.text_config(model.config), "max_position_embeddings", None)
        self.context_length = int(length or tokenizer.model_max_length)
        self.codec = Codec(tokenizer, set(self._eos), self.context_length)
        self._pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.engine_config = EngineConfig(pages, page_tokens, max_batch_tokens, max_requests)
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}
        self._backlog: list[Flight] = []
        self._engine: Engine | None = None
        #: Whether what start-up made was frozen (gc.freeze) before an engine died: the next
        #: engine's is frozen in turn once it is up.
        self._refreeze = False
        self._done: Done | None = None
        self._closing = threading.Event()
        self._collector: threading.Thread | None = None
        self._alone = ThreadPoolExecutor(1, thread_name_prefix="zkq-hf-alone")
        self._ids = itertools.count()
        self._plain = PlainPath(model, self.codec, self._pad)

    # -- what the worker reads ----------------------------------------------------------------

    @property
    def page_tokens(self) -> int:
        return self.engine_config.page_tokens

    @property
    def cache_pages(self) -> int:
        return self.engine_config.pages

    @property
    def device(self) -> torch.device:
        return torch.device(self._model.device)

    @property
    def dtype_bytes(self) -> int:
        return torch.tensor([], dtype=self._model.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the resident parameters and buffers (shared tensors counted once)."""
        tensors = {id(t): t for t in [*self._model.parameters(), *self._model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def describe(self) -> dict[str, Any]:
        cfg = self.engine_config
        page_bytes = kvcache.bytes_per_page(self._model.config, self.dtype_bytes, cfg.page_tokens)
        return {
            "runner": "hf",
            "model": self.name,
            "device": str(self.device),
            "dtype": str(self._model.dtype).removeprefix("torch."),
            "weight_bytes": self.weight_bytes,
            "context_length": self.context_length,
            "cache": {
                "pages_total": cfg.pages,
                "page_tokens": cfg.page_tokens,
                "bytes_per_page": page_bytes,
                "max_batch_tokens": cfg.max_batch_tokens,
            },
            "admission": None if self.slots is None else self.slots.record(),
        }

    def count_tokens(self, spec: JobSpec) -> int:
        """Tokens the job's prompt takes, exactly as ``submit`` encodes it (cached per prompt)."""
        return len(self.codec.encode(spec))

    def validate(self, spec: JobSpec) -> str | None:
        """Why this job can never run on this model, or None."""
        try:
            prompt = self.count_tokens(spec)
        except Exception as exc:
            return f"cannot tokenize the prompt: {exc}"
        return self.codec.context_error(prompt, spec.max_new_tokens)

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
        job.decode = self.codec.decode
        try:
            ids = self.codec.encode(job.spec)
        except Exception as exc:  # one unencodable prompt must not reach the engine
            self._finish(job, Outcome(result.FAILED, error=f"cannot tokenize the prompt: {exc}"))
            return
        problem = self.codec.context_error(len(ids), job.spec.max_new_tokens)
        if problem is not None:
            self._finish(job, Outcome(result.FAILED, error=problem))
            return
        runtime = job.spec.max_runtime or self.default_max_runtime
        now = time.monotonic()
        flight = Flight(job, ids, now, now + runtime if runtime else None, runtime)
        if needs_alone(job.spec, self.sampling):
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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the engine side ----------------------------------------------------------------------

    def _build_engine(self) -> Engine:
        engine = Engine(self._model, self.engine_config, self._eos, self.sampling)
        try:
            engine.start()
        except (MemoryError, ValueError, RuntimeError) as exc:
            engine.stop()
            raise ConfigurationError(f"the engine cannot allocate its cache: {exc}") from exc
        return engine

    def _add(self, engine: Engine, flight: Flight) -> None:
        spec = flight.job.spec
        engine.add(
            flight.rid,
            flight.ids,
            max_new_tokens=spec.max_new_tokens,
            sampling=sampling_of(spec),
            stop_at_eos=not spec.ignore_eos,
            stream=streams(spec),
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
            if streams(job.spec):  # an output per step: now is when the token came
                flight.first_token_at = time.time()
        job.progress = len(out.tokens)
        if job.spec.stream:
            job.add_tokens(out.tokens)
        cut = flight.stop_cut(self.codec)
        if cut is not None:
            self._withdraw(out.request_id, result.SUCCEEDED, text=cut, reason="stop")
        elif out.finished and self._pop(out.request_id):
            self._finish(job, flight.finished(self.codec, out.tokens))

    def _watch_clocks(self, now: float) -> None:
        engine = self._engine
        for flight in list(self._flights.values()):
            if engine is not None and not streams(flight.job.spec):
                self._peek(engine, flight)
            if flight.deadline is not None and now >= flight.deadline:
                self._withdraw(flight.rid, result.TIMEOUT)
            elif not flight.warned_slow and now - flight.started > self.slow_after:
                flight.warned_slow = True
                log.warning(
                    "job %s has been running for %.1f s (prompt %d tokens, %d generated)",
                    flight.job.id,
                    now - flight.started,
                    len(flight.ids),
                    len(flight.tokens),
                )

    @staticmethod
    def _peek(engine: Engine, flight: Flight) -> None:
        """A request that does not stream: its tokens so far, read from the engine (progress
        for the lease, and the partial output should it be cancelled or time out)."""
        tokens = engine.tokens_so_far(flight.rid)
        if tokens is not None and len(tokens) > len(flight.tokens):
            flight.tokens = list(tokens)
            flight.job.progress = len(flight.tokens)

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
        # The worker froze what start-up made (workers.daemon), this engine and its cache
        # among it: should the dead engine sit in a reference cycle (an error that holds the
        # loop's frames, say), frozen, it would never be collected, and the new engine would
        # find no memory for its cache. Frozen again once the new engine is up.
        self._refreeze = self._refreeze or gc.get_freeze_count() > 0
        gc.unfreeze()
        engine.stop()
        gc.collect()

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
        if self._refreeze:
            self._refreeze = False
            gc.collect()
            gc.freeze()

    # -- ending jobs --------------------------------------------------------------------------

    def _pop(self, rid: str) -> Flight | None:
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
            if not streams(flight.job.spec):
                self._peek(engine, flight)  # the partial output, before the engine drops it
            engine.cancel(rid)
        if status == result.CANCELLED:
            status, how["error"] = flight.cancelled()
        elif status == result.TIMEOUT:
            status, how["error"] = flight.timed_out()
        self._end(flight, status, **how)

    def _end(self, flight: Flight, status: str, **how: Any) -> None:
        self._finish(flight.job, flight.outcome(self.codec, status, **how))

    def _finish(self, job: RunningJob, outcome: Outcome) -> None:
        assert self._done is not None, "start() the runner first"
        try:
            self._done(job, outcome)
        except Exception:  # the worker's trouble must not kill the collector
            log.exception("job %s: reporting its outcome failed", job.id)

    # -- the path for what the engine cannot serve -------------------------------------------

    def _run_alone(self, flight: Flight) -> None:
        spec = flight.job.spec
        seed = spec.seed if sampling_of(spec) is not None else None
        self._finish(flight.job, self._plain.run(flight, self._exclusive(seed)))

    @contextlib.contextmanager
    def _exclusive(self, seed: int | None) -> Iterator[None]:
        """For a seeded job: the engine parked (no other draw from the RNG) and the RNG forked."""
        engine = self._engine
        if seed is None or engine is None:
            yield
            return
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        pause = engine.paused() if engine.sampling else contextlib.nullcontext()
        with pause, torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield
