"""Admission at the engine's throughput knee: how many jobs a model worker holds at once.

A job inside the engine is beyond the queue's priorities: the engine serves what it holds in
arrival order, so a worker that admits hundreds of jobs makes a high-priority job queue behind
them. Past some batch size a larger batch only adds latency (every step costs more) for little
or no more tokens/s. The worker therefore admits only as many jobs as keep the engine near its
best throughput, the *knee*, and the rest wait in the queue, where priority applies.

The knee is measured once at start (``measure_curve``): generated tokens/s against the requests
in flight, 1, 2, 4, ... up to the slot cap and what the cache pages allow, on the worker's own
model, device, dtype and engine settings, through the same adapter (``workers.runners.engine``).
Every request has the same shape (``PROMPT_TOKENS`` random prompt tokens, ``NEW_TOKENS`` new
tokens, end-of-sequence ignored), all sent at once as one wave. It stops once throughput stops
rising (``FLAT_DOUBLINGS`` doublings in a row each under ``RISE``) or ``BUDGET_S`` is spent. The
knee is the smallest size whose tokens/s is at least ``KNEE_FRACTION`` of the best measured
(``knee``). The result is cached per model and device (``CalibrationCache``), so a restart reads
it instead of measuring again. Workers that start together on one host take turns
(``CalibrationCache.turn``, a file lock beside the cache): the first measures on a quiet device,
the others wait and read its result, instead of measuring against each other.

``--max-concurrency`` overrides all of this; ``--no-calibrate`` takes ``RULE_SLOTS`` instead.
Slots never exceed what the KV cache admits (a page per job at least).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from workers import kvcache
from workers.options import MODEL_SLOTS, WorkerOptions
from workers.runners.engine import Engine, EngineConfig

log = logging.getLogger("zkq.worker")

#: The knee is the smallest size with at least this share of the best tokens/s measured. Chosen
#: from measurement (BENCHMARKS.md, "Admission at the engine's knee"): below 0.9 the knee can
#: fall short of the target of 0.9x the best throughput (on the tiny model on the CPU, 8 in
#: flight made 0.83 of the best, so 0.8 would have stepped 8); above it the choice flips with
#: the noise between sizes on the plateau (16 made 0.955 of 32's figure in one run), doubling
#: every job's time per token for a few percent. At 0.9 a low-priority backlog ran at 0.93x the
#: best old setting and a high-priority job behind it answered 36x sooner than before.
KNEE_FRACTION = 0.9
#: The calibration requests' shape: a short chat turn's prompt and answer.
PROMPT_TOKENS = 100
NEW_TOKENS = 64
#: Throughput "stops rising" after this many doublings in a row, each under this gain.
FLAT_DOUBLINGS = 2
RISE = 1.05
#: Seconds the measurement may take at most, by device type (a size is only started when its
#: predicted time fits what is left; a GPU step of a big model is slower than the tiny model's).
BUDGET_S = {"cpu": 6.0, "cuda": 30.0}
#: Slots without calibration (``--no-calibrate``): on the CPU the tiny model's measured best
#: step (16 requests: 1.15-1.2x the tokens/s of 64 on mixed prompts, and the knee measured
#: here); on a GPU a middle figure, not measured on one here, between the CPU's and the old
#: GPU step of 256: measure (the default) or set ``--max-concurrency`` there.
RULE_SLOTS = {"cpu": 16, "cuda": 64}
#: How long a start waits for another start's calibration of the same key before measuring
#: anyway (several budgets: model loading is not in the budget).
TURN_WAIT_S = {"cpu": 60.0, "cuda": 180.0}
_TURN_POLL = 0.2
#: Bumped when the measurement changes, so older cached results are measured again.
METHOD = 1

#: One measured point: (requests in flight, generated tokens/s).
Point = tuple[int, float]


@dataclass(frozen=True)
class Slots:
    """The jobs a model worker holds at once and how that figure was found."""

    count: int
    #: "measured", "cached" (measured by an earlier start), "rule" or "flag".
    source: str
    curve: tuple[Point, ...] = ()
    #: Where it came from: the flag, the rule's device, the cache file, the seconds measured.
    detail: str = ""

    def record(self) -> dict[str, Any]:
        """For the worker registration (``describe``)."""
        out: dict[str, Any] = {"slots": self.count, "source": self.source}
        if self.curve:
            out["curve"] = [[n, round(tok_s, 1)] for n, tok_s in self.curve]
            out["fraction"] = KNEE_FRACTION
        return out

    def text(self) -> str:
        """The start line's words: ``16 slots (measured; tokens/s by requests in flight ...)``."""
        curve = " ".join(f"{n}:{tok_s:.0f}" for n, tok_s in self.curve)
        how = self.source + (f", {self.detail}" if self.detail else "")
        if curve:
            how += f"; tokens/s by requests in flight {curve}; knee at {KNEE_FRACTION:.0%} of best"
        return f"{self.count} slot(s) ({how})"


def knee(curve: Sequence[Point], fraction: float = KNEE_FRACTION) -> int:
    """The smallest size whose tokens/s is at least ``fraction`` of the best in ``curve``."""
    if not curve:
        raise ValueError("an empty curve has no knee")
    best = max(tok_s for _, tok_s in curve)
    return min(n for n, tok_s in curve if tok_s >= fraction * best)


def sizes_up_to(cap: int) -> list[int]:
    """1, 2, 4, ... below ``cap``, then ``cap`` itself."""
    sizes = [1 << i for i in range(cap.bit_length()) if 1 << i < cap]
    return [*sizes, cap]


def flat(curve: Sequence[Point]) -> bool:
    """Throughput stopped rising: the last ``FLAT_DOUBLINGS`` steps each gained under ``RISE``."""
    if len(curve) <= FLAT_DOUBLINGS:
        return False
    last = [tok_s for _, tok_s in curve[-FLAT_DOUBLINGS - 1 :]]
    return all(b < a * RISE for a, b in itertools.pairwise(last))


class CalibrationError(Exception):
    """The measurement could not finish (the engine died or stopped answering)."""


def measure_curve(
    engine: Engine,
    vocab: int,
    cap: int,
    *,
    budget_s: float,
    prompt_tokens: int = PROMPT_TOKENS,
    new_tokens: int = NEW_TOKENS,
    clock: Callable[[], float] = time.monotonic,
) -> list[Point]:
    """Tokens/s for 1, 2, 4, ... requests in flight (at most ``cap``) on a started ``engine``,
    until throughput stops rising or ``budget_s`` would be exceeded (the next size's time is
    predicted as the last one's scaled by the size)."""
    rng = random.Random(0)
    wave = _Wave(engine, vocab, rng, prompt_tokens)
    wave.run(min(2, cap), 4)  # warm-up: first steps allocate and build what later steps reuse
    start = clock()
    curve: list[Point] = []
    last: tuple[int, float] | None = None  # (size, seconds)
    for n in sizes_up_to(cap):
        if last is not None and clock() - start + last[1] * n / last[0] > budget_s:
            break
        began = clock()
        tokens = wave.run(n, new_tokens)
        seconds = max(clock() - began, 1e-9)
        curve.append((n, tokens / seconds))
        last = (n, seconds)
        if flat(curve):
            break
    return curve


class _Wave:
    """Sends ``n`` requests of one shape at once and waits for all of them."""

    def __init__(self, engine: Engine, vocab: int, rng: random.Random, prompt: int) -> None:
        self.engine, self.vocab, self.rng, self.prompt = engine, vocab, rng, prompt
        self.sent = 0

    def run(self, n: int, new_tokens: int) -> int:
        """Generated tokens of ``n`` requests of ``new_tokens`` each."""
        ids = set()
        for _ in range(n):
            rid = f"calibrate-{self.sent}"
            self.sent += 1
            prompt = [self.rng.randrange(self.vocab) for _ in range(self.prompt)]
            if not self.engine.add(
                rid, prompt, max_new_tokens=new_tokens, sampling=None, stop_at_eos=False
            ):
                raise CalibrationError(f"the engine died: {self.engine.failure()}")
            ids.add(rid)
        tokens = 0
        while ids:
            out = self.engine.next_output(timeout=60.0)
            if out is None or out.failed:
                why = out.error if out is not None else self.engine.failure() or "no answer"
                raise CalibrationError(f"a calibration request failed: {why}")
            if out.finished and out.request_id in ids:
                ids.discard(out.request_id)
                tokens += len(out.tokens)
        return tokens


# -- the cache ---------------------------------------------------------------------------------


def cache_dir(explicit: str | None = None) -> Path:
    """``explicit``, else ``$CACHE_DIRECTORY`` (systemd's ``CacheDirectory=``; the first of a
    colon-separated list), else ``$XDG_CACHE_HOME/zkq``, else ``~/.cache/zkq``."""
    if explicit:
        return Path(explicit).expanduser()
    systemd = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "zkq"


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's model name."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cache_key(model_dir: str | Path, model: Any, config: EngineConfig, sampling: bool) -> dict:
    """What the knee depends on. Pages are left out (on a GPU they follow the free memory, which
    moves between starts); the size is capped by the pages when the result is used instead."""
    path = Path(model_dir).expanduser().resolve()
    config_json = path / "config.json"
    digest = hashlib.sha256(config_json.read_bytes()).hexdigest()[:16]
    return {
        "method": METHOD,
        "model": str(path),
        "config_sha256": digest,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": device_name(torch.device(model.device)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "page_tokens": config.page_tokens,
        "max_batch_tokens": config.max_batch_tokens,
        "sampling": sampling,
        "shape": [PROMPT_TOKENS, NEW_TOKENS, MODEL_SLOTS, KNEE_FRACTION],
    }


@dataclass
class CalibrationCache:
    """One JSON file per key in ``directory``. Reads that fail are misses; writes that fail are
    a warning (a read-only or missing cache must never stop a worker)."""

    directory: Path
    warnings: list[str] = field(default_factory=list)

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.directory / f"knee-{digest}.json"

    def read(self, key: dict) -> dict | None:
        """The stored record for ``key`` (``slots``, ``curve``, ``measured_at``), or None."""
        try:
            record = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            return None
        if not isinstance(record.get("slots"), int) or not isinstance(record.get("curve"), list):
            return None
        return record

    @contextlib.contextmanager
    def turn(self, key: dict, wait_s: float) -> Iterator[bool]:
        """Hold the key's lock (``knee-<digest>.lock``, an flock, released if the process dies)
        while measuring, so that workers started together measure one at a time. Yields False
        when the lock cannot be had (an unwritable directory, or ``wait_s`` passed): the caller
        measures anyway."""
        lock_path = self.path(key).with_suffix(".lock")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = open(lock_path, "a")  # noqa: SIM115 - closed below
        except OSError as exc:
            log.debug("no calibration lock at %s: %s", lock_path, exc)
            yield False
            return
        with handle:
            held = _take_lock(handle, wait_s, lock_path)
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def write(self, key: dict, slots: int, curve: Sequence[Point]) -> None:
        record = {
            "key": key,
            "slots": slots,
            "curve": [[n, round(tok_s, 1)] for n, tok_s in curve],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        target = self.path(key)
        temp = target.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            temp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(temp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            message = f"cannot write the calibration cache {target}: {exc.strerror or exc}"
            self.warnings.append(message)
            log.warning("%s (the knee is measured again at the next start)", message)


def _take_lock(handle: Any, wait_s: float, lock_path: Path) -> bool:
    """Take the exclusive flock on ``handle`` within ``wait_s`` seconds; False when it cannot
    be had (still held by another start after ``wait_s``, or a filesystem without locks)."""
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.warning("another start is still calibrating; measuring anyway")
                return False
            if not announced:
                log.info("another start on this host is calibrating; waiting for it")
                announced = True
            time.sleep(_TURN_POLL)
        except OSError as exc:  # a filesystem without locks
            log.debug("cannot lock %s: %s", lock_path, exc)
            return False


# -- choosing the slots ------------------------------------------------------------------------


def admission_slots(
    opts: WorkerOptions, model: Any, eos: list[int], config: EngineConfig, sampling: bool
) -> Slots:
    """The worker's slots: the flag, the rule, the cached knee or a fresh measurement, never more
    than ``MODEL_SLOTS`` or the cache's pages (a page per job at least). ``config`` is the
    engine's (its ``max_requests`` is ignored: the calibration engine takes every request)."""
    cap = max(1, min(config.pages, MODEL_SLOTS))
    device = torch.device(model.device)
    if opts.max_concurrency is not None:
        return Slots(opts.max_concurrency, "flag", detail="--max-concurrency")
    rule = Slots(
        min(cap, RULE_SLOTS.get(device.type, RULE_SLOTS["cuda"])), "rule", detail=device.type
    )
    if not opts.calibrate:
        return rule
    assert opts.model is not None
    key = cache_key(opts.model, model, config, sampling)
    cache = CalibrationCache(cache_dir(opts.calibration_cache))
    with cache.turn(key, TURN_WAIT_S.get(device.type, TURN_WAIT_S["cuda"])):
        # Read under the lock: a start that held it before us may have just measured.
        record = None if opts.recalibrate else cache.read(key)
        if record is not None:
            stored = tuple((int(n), float(t)) for n, t in record["curve"])
            found = f"{cache.path(key)}, {record.get('measured_at', '?')}"
            return Slots(max(1, min(cap, record["slots"])), "cached", stored, found)
        return _measure(model, eos, config, sampling, cap, cache, key) or rule


def _measure(
    model: Any,
    eos: list[int],
    config: EngineConfig,
    sampling: bool,
    cap: int,
    cache: CalibrationCache,
    key: dict,
) -> Slots | None:
    """Measure the curve and cache its knee; None when it cannot be measured (the rule)."""
    device = torch.device(model.device)
    text = kvcache.text_config(model.config)
    context = int(getattr(text, "max_position_embeddings", 0) or PROMPT_TOKENS + NEW_TOKENS)
    prompt = max(1, min(PROMPT_TOKENS, context - NEW_TOKENS))
    per_request = math.ceil((prompt + NEW_TOKENS) / config.page_tokens)
    largest = min(cap, (config.pages - kvcache.SPARE_PAGES) // per_request)
    if largest < 1:
        log.warning("the KV cache is too small to calibrate admission; using the rule")
        return None
    engine_config = EngineConfig(config.pages, config.page_tokens, config.max_batch_tokens, largest)
    began = time.monotonic()
    engine = Engine(model, engine_config, eos, sampling)
    try:
        engine.start()
        budget = BUDGET_S.get(device.type, BUDGET_S["cuda"])
        curve = measure_curve(
            engine, int(text.vocab_size), largest, budget_s=budget, prompt_tokens=prompt
        )
    except (CalibrationError, RuntimeError, ValueError, MemoryError) as exc:
        log.warning("calibrating admission failed (%s); using the rule", exc)
        return None
    finally:
        engine.stop()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    count = knee(curve)
    cache.write(key, count, curve)
    return Slots(count, "measured", tuple(curve), f"{time.monotonic() - began:.1f} s")
