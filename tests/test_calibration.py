"""Admission at the engine's knee (workers.calibration): the knee of a curve, when measuring
stops, the cache, and a real calibration of the tiny model through ``build_model_runner``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_for
from workers import calibration
from workers.calibration import (
    CalibrationCache,
    Point,
    cache_dir,
    flat,
    knee,
    measure_curve,
    sizes_up_to,
)
from workers.model import build_model_runner, load
from workers.options import WorkerOptions
from workers.runners.engine import EngineOutput
from workers.tinymodel import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


# -- the knee of a curve ----------------------------------------------------------------------


def test_knee_is_the_smallest_size_within_the_fraction_of_the_best() -> None:
    rising = [(1, 500.0), (2, 900.0), (4, 1600.0), (8, 2400.0), (16, 2600.0), (32, 2650.0)]
    assert knee(rising, 0.9) == 8  # 2400 >= 0.9 * 2650; 1600 is not
    assert knee(rising, 0.95) == 16
    assert knee(rising, 1.0) == 32
    peaked = [(1, 600.0), (2, 1100.0), (4, 2000.0), (8, 3000.0), (16, 2500.0), (32, 1800.0)]
    assert knee(peaked, 0.9) == 8
    assert knee([(1, 700.0)]) == 1
    with pytest.raises(ValueError):
        knee([])


def test_sizes_double_up_to_the_cap_and_end_on_it() -> None:
    assert sizes_up_to(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert sizes_up_to(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert sizes_up_to(1) == [1]


def test_flat_means_two_doublings_each_under_five_percent() -> None:
    assert not flat([(1, 100.0), (2, 104.0)])
    assert flat([(1, 100.0), (2, 104.0), (4, 108.0)])
    assert not flat([(1, 100.0), (2, 104.0), (4, 110.0)])
    assert flat([(1, 100.0), (2, 90.0), (4, 80.0)])


class FakeEngine:
    """An engine whose waves take ``n * new_tokens / rate(n)`` seconds of a fake clock."""

    def __init__(self, rate: dict[int, float]) -> None:
        self.rate = rate
        self.now = 0.0
        self.pending: list[tuple[str, int]] = []
        self.sizes: list[int] = []
        self.wave_timed = False

    def clock(self) -> float:
        return self.now

    def add(self, rid: str, ids: list[int], *, max_new_tokens: int, **kw: Any) -> bool:
        assert kw["stop_at_eos"] is False and kw["sampling"] is None
        self.pending.append((rid, max_new_tokens))
        return True

    def next_output(self, timeout: float) -> EngineOutput:
        if not self.wave_timed:  # the wave's first output: the whole wave's time passes
            n = len(self.pending)
            self.sizes.append(n)
            self.now += n * self.pending[0][1] / self.rate.get(n, 1000.0)
            self.wave_timed = True
        rid, tokens = self.pending.pop()
        self.wave_timed = bool(self.pending)
        return EngineOutput(rid, [0] * tokens, True, False, None, None)

    def failure(self) -> str | None:
        return None


def test_measuring_stops_once_throughput_stops_rising() -> None:
    rate = {1: 500.0, 2: 900.0, 4: 1500.0, 8: 1520.0, 16: 1510.0, 32: 1500.0}
    engine = FakeEngine(rate)
    curve = measure_curve(engine, 100, 256, budget_s=1e9, clock=engine.clock)  # type: ignore[arg-type]
    assert [n for n, _ in curve] == [1, 2, 4, 8, 16]
    assert knee(curve) == 4
    assert engine.sizes[0] == 2  # the warm-up wave, not on the curve


def test_measuring_stops_before_a_size_that_would_overrun_the_budget() -> None:
    engine = FakeEngine({n: 100.0 * n for n in (1, 2, 4, 8, 16, 32, 64)})
    # Each wave takes 0.64 s whatever its size; the next one is predicted as the last one scaled
    # by the size: 2 (1.28 s) and 4 (2.56 s) fit a budget of 3 s, 8 (1.92 + 2.56 s) would not.
    curve = measure_curve(engine, 100, 64, budget_s=3.0, new_tokens=64, clock=engine.clock)  # type: ignore[arg-type]
    assert [n for n, _ in curve] == [1, 2, 4]


# -- the cache --------------------------------------------------------------------------------


KEY = {"method": 1, "model": "/m", "config_sha256": "ab", "device": "cpu", "torch_threads": 2}
CURVE: list[Point] = [(1, 500.0), (2, 900.0), (4, 950.0)]


def test_cache_hit_and_a_miss_on_a_changed_key(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path / "c")
    assert cache.read(KEY) is None
    cache.write(KEY, 2, CURVE)
    record = cache.read(KEY)
    assert record is not None and record["slots"] == 2 and record["curve"][-1] == [4, 950.0]
    assert cache.read({**KEY, "torch_threads": 4}) is None
    assert cache.read({**KEY, "config_sha256": "cd"}) is None
    assert CalibrationCache(tmp_path / "c").read(KEY) is not None  # another process reads it


def test_a_corrupt_or_foreign_cache_file_is_a_miss(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path)
    cache.path(KEY).write_text("{not json")
    assert cache.read(KEY) is None
    cache.path(KEY).write_text(json.dumps({"key": {"other": 1}, "slots": 3, "curve": []}))
    assert cache.read(KEY) is None


def test_an_unwritable_cache_is_a_warning_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = CalibrationCache(blocker / "cache")  # a directory under a file can never be made
    with caplog.at_level(logging.WARNING, logger="zkq.worker"):
        cache.write(KEY, 2, CURVE)
    assert cache.read(KEY) is None
    assert cache.warnings and "cannot write the calibration cache" in caplog.text


_HOLDER = """
import json, sys
from pathlib import Path
from workers.calibration import CalibrationCache
cache, key = CalibrationCache(Path(sys.argv[1])), json.loads(sys.argv[2])
with cache.turn(key, 5) as held:
    print("held" if held else "not held", flush=True)
    sys.stdin.readline()
    cache.write(key, 7, [(1, 10.0), (7, 70.0)])
"""


def test_starts_on_one_host_take_turns_and_the_second_reads_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process measures (holds the key's lock); this start waits for it, then reads
    its knee instead of measuring against it. A start that waits too long measures anyway."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), json.dumps(KEY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        cache = CalibrationCache(tmp_path)
        with cache.turn(KEY, 0.3) as got:
            assert got is False  # the wait is bounded
        seen: dict[str, Any] = {}

        def second_start() -> None:
            with cache.turn(KEY, 30) as held:
                seen["held"], seen["record"] = held, cache.read(KEY)

        with caplog.at_level(logging.INFO, logger="zkq.worker"):
            waiter = threading.Thread(target=second_start)
            waiter.start()
            wait_for(lambda: "is calibrating; waiting for it" in caplog.text, timeout=10)
            assert "record" not in seen
            holder.stdin.write("measured\n")
            holder.stdin.flush()
            waiter.join(30)
        assert seen["held"] is True
        assert seen["record"] is not None and seen["record"]["slots"] == 7
    finally:
        holder.kill()
        holder.wait(10)


def test_cache_dir_follows_systemd_then_xdg_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}/sd:{tmp_path}/other")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "sd"
    assert cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    monkeypatch.delenv("CACHE_DIRECTORY")
    assert cache_dir() == tmp_path / "xdg" / "zkq"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "zkq"


# -- a model worker's slots ---------------------------------------------------------------------


def test_calibration_on_the_tiny_model_is_measured_then_cached(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    opts = WorkerOptions(model=str(tiny_dir), device="cpu", calibration_cache=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="zkq.worker"):
        runner, admission = build_model_runner(opts)
    try:
        slots = runner.slots
        assert slots is not None and slots.source == "measured"
        assert admission.pages_total is not None
        assert 1 <= slots.count <= min(256, admission.pages_total)
        assert slots.count == calibration.knee(slots.curve)
        assert [n for n, _ in slots.curve][:3] == [1, 2, 4]
        assert all(tok_s > 0 for _, tok_s in slots.curve)
        assert runner.engine_config.max_requests == slots.count  # no job waits in the engine
        assert runner.describe()["admission"]["source"] == "measured"
        assert f"admission: {slots.count} slot(s) (measured" in caplog.text
    finally:
        runner.close()
    assert len(list(tmp_path.glob("knee-*.json"))) == 1
    again, _ = build_model_runner(opts)
    try:
        assert again.slots is not None and again.slots.source == "cached"
        assert again.slots.record() == {**slots.record(), "source": "cached"}  # curve rounded
        assert again.describe()["admission"]["curve"][0][0] == 1
    finally:
        again.close()


def test_a_cached_knee_is_capped_by_the_cache_pages(tiny_dir: Path, tmp_path: Path) -> None:
    """A knee measured on a larger cache never admits more jobs than this cache has pages."""
    opts = WorkerOptions(
        model=str(tiny_dir),
        device="cpu",
        vram_budget=48 << 20,
        calibration_cache=str(tmp_path),
        calibrate=False,
    )
    runner, admission = build_model_runner(opts)
    try:
        pages = admission.pages_total
        assert pages is not None
        _, model = load(tiny_dir, torch.device("cpu"), torch.float32)
        key = calibration.cache_key(tiny_dir, model, runner.engine_config, sampling=True)
    finally:
        runner.close()
    CalibrationCache(tmp_path).write(key, pages + 50, CURVE)
    runner, admission = build_model_runner(replace(opts, calibrate=True))
    try:
        assert runner.slots is not None and runner.slots.source == "cached"
        assert runner.slots.count == min(256, pages)
    finally:
        runner.close()


def test_max_concurrency_and_no_calibrate_skip_the_measurement(
    tiny_dir: Path, tmp_path: Path
) -> None:
    flag = WorkerOptions(
        model=str(tiny_dir), device="cpu", max_concurrency=3, calibration_cache=str(tmp_path)
    )
    runner, _ = build_model_runner(flag)
    try:
        assert runner.slots is not None and (runner.slots.count, runner.slots.source) == (3, "flag")
        assert runner.engine_config.max_requests == 3
        assert runner.describe()["admission"] == {"slots": 3, "source": "flag"}
    finally:
        runner.close()
    rule = WorkerOptions(
        model=str(tiny_dir), device="cpu", calibrate=False, calibration_cache=str(tmp_path)
    )
    runner, _ = build_model_runner(rule)
    try:
        assert runner.slots is not None
        assert (runner.slots.count, runner.slots.source) == (calibration.RULE_SLOTS["cpu"], "rule")
    finally:
        runner.close()
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing cached
