"""The adapter to transformers' continuous batching: every call into its API lives in this module.

Supported: **transformers >= 5.24, < 5.25** (pinned in setup.cfg's ``worker`` extra). The API
moves between minor versions; before widening the range, re-check what this module relies on:

* ``model.init_continuous_batching(generation_config=, continuous_batching_config=)`` with
  ``ContinuousBatchingConfig(num_blocks, page_size, max_batch_tokens, max_requests_per_batch,
  per_request_processors, max_memory_percent)``; ``manager.warmup()`` builds the paged cache on
  the calling thread (so a cache that cannot be allocated raises at start, not in the loop),
  ``start``, ``stop``, ``is_running``, ``pause`` (a context that parks the loop between steps).
* ``add_request(ids, request_id, max_new_tokens, streaming, record_timestamps, eos_token_id,
  temperature=, top_k=, top_p=)``: the sampling knobs are per request only when the manager's
  generation config creates those processors and ``per_request_processors`` is on; an
  ``eos_token_id`` of -1 means "no end of sequence". ``add_request`` returns None once the loop
  has died.
* ``get_result(timeout)`` yields ``GenerationOutput`` (``request_id``, ``generated_tokens``,
  ``status``, ``error``, ``timestamps``, ``created_time``); a streamed request yields one per step.
  ``cancel_request`` never yields a finished output: the caller ends the request itself.
* A dead loop: ``is_running()`` is False, requests in flight come back FAILED (or not at all).
* ``batch_processor.scheduler.get_active_request_static_outputs(id)``: the tokens a running
  request generated so far, read without streaming it (``tokens_so_far``).
  ``background_thread_status.fatal_error`` and ``batch_processor.cache`` are read, defensively,
  for the error message and the pages in use.

Sampling: ``do_sample`` is one setting per manager, so a manager that serves sampled requests
samples for all: a greedy request asks for ``top_k=1`` (the argmax, as ``generate`` picks it; only
an exact tie for the top logit, possible in half precision, would be broken at random instead of
by the lower token id), a sampled one sets its temperature and top_p, with top_k off. That costs
every step a softmax, a draw and the three processors over the batch's logits (each with its own
Python preparation): on the CPU benchmark of the tiny model (64 mixed greedy prompts of 7-240
tokens, 16 or 64 in flight, one thread) the HF runner made ~3,450 tokens/s on a sampling manager
and ~4,200 on a greedy-only one, against ~4,400 for the library driven directly (greedy).
``Engine(sampling=False)`` builds the greedy-only manager; sampled jobs then go the plain path.

What continuous batching cannot serve runs alone through plain ``generate``
(``workers.runners.flight.PlainPath``): a *seeded* sampled job (the manager's RNG is shared by
every request and seeded once per manager; the job runs under ``torch.random.fork_rng`` with the
engine paused, so no other draw interleaves) and a job with ``min_new_tokens`` (transformers
drops ``MinNewTokensLengthLogitsProcessor`` under continuous batching and has no per-request
equivalent). ``ignore_eos`` is served per request (``eos_token_id=-1``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from workers import kvcache

log = logging.getLogger("zkq.engine")

#: The library's own logger; its "no psutil" complaints on CPU are harmless (the cache is sized
#: explicitly) and are dropped.
_LIBRARY_LOGGER = "ContinuousBatchingLogger"
_HARMLESS = ("Cannot get memory breakdown on CPU without psutil", "psutil is not available")
#: Defaults that make the manager create its temperature, top-k and top-p processors; every
#: request overrides all three.
_PROCESSOR_DEFAULTS = {"temperature": 0.5, "top_k": 50, "top_p": 0.9}


@dataclass(frozen=True)
class EngineConfig:
    """The cache and batch shape, always explicit (the library's own sizing is never used)."""

    pages: int
    page_tokens: int
    max_batch_tokens: int
    #: Requests in one batch at most (None: the library's default).
    max_requests: int | None = None


@dataclass(frozen=True)
class Sampling:
    """A sampled request's knobs; greedy requests pass None instead."""

    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class EngineOutput:
    """One output of the engine, in this module's terms."""

    request_id: str
    tokens: list[int]
    finished: bool
    failed: bool
    error: str | None
    #: Seconds from ``add`` to the first generated token, where known.
    ttft_s: float | None


class Engine:
    """One continuous-batching manager over ``model`` with a cache of exactly ``config.pages``
    pages. Not restartable: after the loop dies, ``stop`` it and build another."""

    def __init__(
        self, model: Any, config: EngineConfig, eos_ids: list[int], sampling: bool = True
    ) -> None:
        """``sampling``: serve sampled requests beside greedy ones (see the module docstring);
        False makes a greedy-only engine, which skips the per-step sampling work."""
        _quiet_library_logger()
        self.config = config
        self.sampling = sampling
        self._vocab = int(kvcache.text_config(model.config).vocab_size)
        self._eos = list(eos_ids)
        knobs = _PROCESSOR_DEFAULTS if sampling else {}
        generation = GenerationConfig(do_sample=sampling, eos_token_id=self._eos or None, **knobs)
        batching = ContinuousBatchingConfig(
            num_blocks=config.pages,
            page_size=config.page_tokens,
            max_batch_tokens=config.max_batch_tokens,
            max_requests_per_batch=config.max_requests,
            per_request_processors=sampling,
            # Our sizing already kept the reserve and the step's peak out; let the library's own
            # check compare against all the free memory rather than a share of it.
            max_memory_percent=1.0,
        )
        self._manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=batching
        )
        self._started = False

    def start(self) -> None:
        """Allocate the cache here (raising if it cannot be) and start the generation loop."""
        with torch.inference_mode():
            self._manager.warmup()
            self._manager.start()
        self._started = True

    def add(
        self,
        request_id: str,
        ids: list[int],
        *,
        max_new_tokens: int,
        sampling: Sampling | None,
        stop_at_eos: bool = True,
        stream: bool = False,
    ) -> bool:
        """Queue one request; False if the loop can no longer take it (it died)."""
        knobs: dict[str, Any] = {}
        if not self.sampling:
            if sampling is not None:
                raise ValueError("this engine is greedy-only")
        elif sampling is None:
            knobs = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        else:
            knobs = {"temperature": sampling.temperature, "top_k": self._vocab}
            knobs["top_p"] = sampling.top_p
        added = self._manager.add_request(
            ids,
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            streaming=stream,
            record_timestamps=True,
            eos_token_id=self._eos if stop_at_eos else -1,
            **knobs,
        )
        return added is not None

    def cancel(self, request_id: str) -> None:
        self._manager.cancel_request(request_id)

    def next_output(self, timeout: float) -> EngineOutput | None:
        """The next output of any request, or None after ``timeout`` seconds (at once if the loop
        is dead and nothing is left)."""
        out = self._manager.get_result(timeout=timeout)
        if out is None:
            return None
        status = getattr(out.status, "name", str(out.status))
        stamps = out.timestamps
        return EngineOutput(
            request_id=str(out.request_id),
            tokens=list(out.generated_tokens),
            finished=out.is_finished(),
            failed=status == "FAILED",
            error=out.error,
            ttft_s=stamps[0] - out.created_time if stamps else None,
        )

    def tokens_so_far(self, request_id: str) -> list[int] | None:
        """The tokens a request has generated so far, read from the scheduler without asking
        the request to stream (None when the library cannot tell, or it is not running yet).
        The list is the engine's own: copy it before keeping it."""
        try:
            scheduler = self._manager.batch_processor.scheduler
            tokens = scheduler.get_active_request_static_outputs(request_id)
        except Exception:  # the library moved it: callers then stream the request
            return None
        return tokens if isinstance(tokens, list) else None

    def alive(self) -> bool:
        return bool(self._manager.is_running())

    def failure(self) -> str | None:
        """Why the loop died, if the library recorded it."""
        status = getattr(self._manager, "background_thread_status", None)
        error = getattr(status, "fatal_error", None)
        return None if error is None else repr(error)

    def pages_in_use(self) -> int | None:
        """Pages held by requests (and kept for prefix sharing), read from the cache's pool."""
        try:
            cache = self._manager.batch_processor.cache
            free = float(cache.compute_free_capacity(relative=True))
            return max(0, round(int(cache.num_blocks) * (1.0 - free)))
        except Exception:  # no cache yet, or the library moved it: the figure is optional
            return None

    def allocated_bytes(self) -> int | None:
        """Bytes of the cache tensor the library allocated (None before ``start``)."""
        try:
            return int(self._manager.batch_processor.cache.cache_tensor.nbytes)
        except Exception:
            return None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Park the generation loop between two steps for the duration of the block."""
        if not self.alive():
            yield
            return
        with self._manager.pause():
            yield

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (failing what it still holds) and free the cache."""
        if not self._started:
            return
        self._started = False
        self._manager.stop(block=True, timeout=timeout, hard_stop=True)


class _Harmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_HARMLESS)


_quiet_lock = threading.Lock()


def _quiet_library_logger() -> None:
    with _quiet_lock:
        logger = logging.getLogger(_LIBRARY_LOGGER)
        if not any(isinstance(f, _Harmless) for f in logger.filters):
            logger.addFilter(_Harmless())
