"""One job's flight through the HF runner: its record, its outcome, and the plain path.

The plain path runs a job alone through ``model.generate``, for what the continuous-batching
engine cannot serve (see ``workers.runners.engine``): a seeded sampled job (the caller seeds a
forked RNG and parks the engine around it), a job with ``min_new_tokens``, and sampled jobs when
the engine is greedy-only. There ``ignore_eos`` suppresses end-of-sequence, as
``min_new_tokens=max_new_tokens`` does. Cancellation, ``max_runtime`` and stop strings are checked
after every step, as on the engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria

from workers.runners.base import Outcome, RunningJob
from workers.runners.codec import Codec
from workers.runners.engine import Sampling
from zkqueue.protocol import result
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.runner")


@dataclass(eq=False)
class Flight:
    """One job inside the runner, from ``submit`` to its outcome."""

    job: RunningJob
    ids: list[int]
    started: float
    deadline: float | None
    runtime: float | None
    #: The engine's request id ("" on the plain path).
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    #: When the worker had the first token (unix seconds), as the openai runner reports it.
    first_token_at: float | None = None
    warned_slow: bool = False

    def stop_cut(self, codec: Codec) -> str | None:
        """The output before the first stop string, once one was generated."""
        spec = self.job.spec
        if not spec.stop:
            return None
        return codec.stop_cut(codec.trim(self.tokens, spec.ignore_eos)[0], spec.stop)

    def cancelled(self) -> tuple[str, str]:
        """(status, error) of a job stopped by its cancellation."""
        why = self.job.cancel_reason or "cancelled"
        return result.CANCELLED, f"job was {why} after {len(self.tokens)} tokens"

    def timed_out(self) -> tuple[str, str]:
        """(status, error) of a job stopped by its max_runtime."""
        runtime = self.runtime or 0.0
        return (
            result.TIMEOUT,
            f"max_runtime of {runtime:g} s reached after {len(self.tokens)} tokens",
        )

    def outcome(
        self,
        codec: Codec,
        status: str,
        *,
        tokens: list[int] | None = None,
        text: str | None = None,
        reason: str | None = None,
        error: str | None = None,
        release: bool = False,
    ) -> Outcome:
        """The job's outcome with its figures; ``tokens`` default to those generated so far."""
        tokens = self.tokens if tokens is None else tokens
        if text is None:
            text = codec.decode(tokens) if tokens else ""
        self.job.progress = len(tokens)
        extra = {
            "prompt_tokens": len(self.ids),
            "output_tokens": len(tokens),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "first_token_at": self.first_token_at,
            "total_s": round(time.monotonic() - self.started, 6),
            "finish_reason": reason,
        }
        return Outcome(status, text, error, extra, release)

    def finished(self, codec: Codec, tokens: list[int]) -> Outcome:
        """The outcome of a job that generated ``tokens`` to its end (eos or max_new_tokens)."""
        kept, reason = codec.trim(tokens, self.job.spec.ignore_eos)
        return self.outcome(codec, result.SUCCEEDED, tokens=kept, reason=reason)


def sampling_of(spec: JobSpec) -> Sampling | None:
    """The job's sampling knobs, or None for greedy decoding (no temperature nor top_p, or a
    temperature of 0)."""
    if spec.temperature == 0 or (spec.temperature is None and spec.top_p is None):
        return None
    temperature = 1.0 if spec.temperature is None else float(spec.temperature)
    return Sampling(temperature, 1.0 if spec.top_p is None else float(spec.top_p))


class PlainPath:
    """Runs one flight at a time through ``model.generate``."""

    def __init__(self, model: Any, codec: Codec, pad_id: int) -> None:
        self.model, self.codec, self.pad_id = model, codec, pad_id

    def run(self, flight: Flight, exclusive: contextlib.AbstractContextManager[Any]) -> Outcome:
        """Generate for ``flight`` inside ``exclusive`` (seeding, pausing); never raises."""
        job, spec = flight.job, flight.job.spec
        ended: list[tuple[str, str]] = []

        def on_step(tokens: list[int]) -> bool:
            now = time.monotonic()
            flight.tokens, job.progress = tokens, len(tokens)
            if flight.ttft_s is None:
                flight.ttft_s = now - flight.started
                flight.first_token_at = time.time()
            if spec.stream:
                job.add_tokens(tokens)
            if job.cancelled.is_set():
                ended.append(flight.cancelled())
            elif flight.deadline is not None and now >= flight.deadline:
                ended.append(flight.timed_out())
            return bool(ended) or flight.stop_cut(self.codec) is not None

        try:
            with exclusive:
                self._generate(flight, on_step)
        except Exception as exc:
            log.exception("generate failed for job %s", job.id)
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            error = f"generation failed: {exc}"
            return flight.outcome(self.codec, result.FAILED, error=error, release=oom)
        if ended:
            status, error = ended[0]
            return flight.outcome(self.codec, status, error=error)
        cut = flight.stop_cut(self.codec)
        if cut is not None:
            return flight.outcome(self.codec, result.SUCCEEDED, text=cut, reason="stop")
        return flight.finished(self.codec, flight.tokens)

    def _generate(self, flight: Flight, on_step: Callable[[list[int]], bool]) -> None:
        spec = flight.job.spec
        sampling = sampling_of(spec)
        knobs: dict[str, Any] = {"do_sample": False}
        if sampling is not None:
            knobs = {"do_sample": True, "temperature": sampling.temperature, "top_k": 0}
            knobs["top_p"] = sampling.top_p
        config = GenerationConfig(
            max_new_tokens=spec.max_new_tokens,
            min_new_tokens=spec.max_new_tokens if spec.ignore_eos else spec.min_new_tokens,
            eos_token_id=sorted(self.codec.eos_ids),
            pad_token_id=self.pad_id,
            **knobs,
        )
        prompt = torch.tensor([flight.ids], device=self.model.device)
        with torch.inference_mode():
            self.model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                generation_config=config,
                stopping_criteria=[_StepHook(len(flight.ids), on_step)],
            )


class _StepHook(StoppingCriteria):
    """Hands the tokens so far to ``on_step`` after every step; stops when it says so."""

    def __init__(self, width: int, on_step: Callable[[list[int]], bool]) -> None:
        self.width, self.on_step = width, on_step

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        stop = self.on_step(input_ids[0, self.width :].tolist())
        return torch.tensor([stop], device=input_ids.device)  # type: ignore[return-value]


def streams(spec: JobSpec) -> bool:
    """Whether the engine streams the job (an output per step): for a caller who streams, and
    for stop strings, checked at every step. Other jobs are read from the engine every clock
    tick instead (``HFRunner._peek``): per-step outputs cost the engine's thread ~4%."""
    return spec.stream or bool(spec.stop)


def needs_alone(spec: JobSpec, engine_samples: bool) -> bool:
    """Jobs the engine cannot serve: seeded sampling, min_new_tokens, and any sampling on a
    greedy-only engine (see engine.py)."""
    sampled = sampling_of(spec) is not None
    if sampled and (spec.seed is not None or not engine_samples):
        return True
    return bool(spec.min_new_tokens) and not spec.ignore_eos
