"""Memory probes: the static budget and its ledger for real, the GPU probes where there is a GPU,
and the CUDA_VISIBLE_DEVICES mapping against a stand-in NVML."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from workers import memory
from workers.memory import (
    MeminfoProbe,
    MemorySnapshot,
    StaticBudget,
    admission_free,
    make_probe,
    parse_meminfo,
    visible_devices,
)
from zkqueue.errors import ConfigurationError

MiB = 2**20


# -- static budget ------------------------------------------------------------------------------


def test_static_budget_counts_weights_and_reservations() -> None:
    budget = StaticBudget(1000 * MiB, 300 * MiB)
    assert budget.snapshot() == MemorySnapshot(
        total=1000 * MiB, free=700 * MiB, reserved_by_jobs=0, device_free=700 * MiB, source="static"
    )
    budget.reserve(200 * MiB)
    budget.reserve(100 * MiB)
    snap = budget.snapshot()
    assert (snap.free, snap.reserved_by_jobs) == (400 * MiB, 300 * MiB)
    budget.release(200 * MiB)
    assert budget.snapshot().free == 600 * MiB
    budget.release(100 * MiB)
    assert budget.snapshot().free == 700 * MiB


def test_static_budget_never_reports_negative_free() -> None:
    budget = StaticBudget(100, 10)
    budget.reserve(500)
    assert budget.snapshot().free == 0


def test_try_reserve_is_all_or_nothing() -> None:
    budget = StaticBudget(100, 20)
    assert budget.try_reserve(50)
    assert not budget.try_reserve(31)
    assert budget.try_reserve(30)
    assert budget.snapshot().free == 0


def test_release_more_than_reserved_is_a_bug() -> None:
    budget = StaticBudget(100)
    budget.reserve(10)
    with pytest.raises(ValueError, match="exceeds"):
        budget.release(11)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_reserve_refuses_non_byte_counts(bad: Any) -> None:
    with pytest.raises(ValueError):
        StaticBudget(100).reserve(bad)


def test_weights_larger_than_budget_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="do not fit"):
        StaticBudget(100, 101)


def test_ledger_is_thread_safe() -> None:
    budget = StaticBudget(10**12)
    barrier = threading.Barrier(8)

    def churn() -> None:
        barrier.wait()
        for _ in range(2000):
            budget.reserve(3)
            budget.release(3)
        budget.reserve(1)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert budget.snapshot().reserved_by_jobs == 8


# -- make_probe and the CPU fallback ------------------------------------------------------------


def test_make_probe_prefers_a_budget() -> None:
    probe = make_probe("cuda:3", 8 * 2**30, 2**30)
    assert isinstance(probe, StaticBudget)
    assert probe.snapshot().free == 7 * 2**30


@pytest.mark.skipif(not memory.MEMINFO.exists(), reason="no /proc/meminfo")
def test_cpu_without_budget_reads_meminfo() -> None:
    probe = make_probe("cpu", None, 0)
    assert isinstance(probe, MeminfoProbe)
    snap = probe.snapshot()
    assert snap.source == "meminfo"
    assert 0 < snap.free <= snap.total
    probe.reserve(snap.total)
    assert probe.snapshot().free == 0
    probe.close()


def test_meminfo_probe_subtracts_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\n")
    probe = MeminfoProbe(path)
    probe.reserve(100 * 1024)
    snap = probe.snapshot()
    assert (snap.total, snap.device_free, snap.free) == (1000 * 1024, 600 * 1024, 500 * 1024)


def test_parse_meminfo() -> None:
    text = "MemTotal:  16 kB\nHugePages_Total:       0\nBogus line\nMemAvailable: 8 kB\n"
    assert parse_meminfo(text) == {"MemTotal": 16384, "HugePages_Total": 0, "MemAvailable": 8192}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_probe_without_a_gpu_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        make_probe("cuda:0", None, 0)


def test_bad_cuda_device_name() -> None:
    with pytest.raises(ConfigurationError, match="cuda:N"):
        make_probe("cuda:x", None, 0)


# -- the admission figure -----------------------------------------------------------------------


def test_admission_free_without_torch_figures_subtracts_the_whole_ledger() -> None:
    assert admission_free(1000, 300, 50, None, None) == 700
    assert admission_free(100, 300, 50, None, None) == 0


def test_admission_free_counts_reusable_cache_and_unallocated_promises() -> None:
    # Weights 400; jobs promised 300 and have allocated 100 of it; torch caches 50 unused.
    allocated, cached = 400 + 100, 400 + 100 + 50
    assert admission_free(1000, 300, 400, allocated, cached) == 1000 + 50 - 200
    # Jobs that outgrew their promise leave nothing outstanding.
    assert admission_free(1000, 100, 400, 400 + 500, 900) == 1000


# -- CUDA_VISIBLE_DEVICES mapping ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (None, None),
        ("", []),
        ("0,1", ["0", "1"]),
        (" 2 , 0 ", ["2", "0"]),
        ("1,-1,0", ["1"]),
        ("GPU-8f2c,MIG-11aa", ["GPU-8f2c", "MIG-11aa"]),
        ("1,foo,2", ["1"]),
    ],
)
def test_visible_devices(env: str | None, expected: list[str] | None) -> None:
    assert visible_devices(env) == expected


class FakeNvml:
    """Enough of pynvml for the index/UUID mapping: physical devices 0..2."""

    class NVMLError(Exception):
        pass

    UUIDS = ("GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-bbbc-3333")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.UUIDS):
            raise self.NVMLError("invalid argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        if uuid not in self.UUIDS:
            raise self.NVMLError("not found")
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.UUIDS[handle].encode()


@pytest.mark.parametrize(
    ("env", "logical", "physical"),
    [
        (None, 1, 1),
        ("2,0", 0, 2),
        ("2,0", 1, 0),
        ("GPU-bbbb-2222", 0, 1),
        ("1,GPU-bbbc", 1, 2),
        ("GPU-a", 0, 0),
    ],
)
def test_logical_index_maps_to_physical(
    monkeypatch: pytest.MonkeyPatch, env: str | None, logical: int, physical: int
) -> None:
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert memory._nvml_handle(FakeNvml(), logical) == physical


@pytest.mark.parametrize(
    ("env", "logical", "message"),
    [
        ("2,0", 2, "not visible"),
        ("", 0, "not visible"),
        ("GPU-bbb", 0, "matches 2"),
        ("GPU-zzzz", 0, "matches 0"),
    ],
)
def test_unmappable_devices(
    monkeypatch: pytest.MonkeyPatch, env: str, logical: int, message: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    with pytest.raises(ConfigurationError, match=message):
        memory._nvml_handle(FakeNvml(), logical)


# -- real GPU probes (skipped without a GPU) ----------------------------------------------------


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.skipif(not _nvml_works(), reason="NVML is not available")
def test_nvml_probe_reads_the_device() -> None:
    probe = memory.NvmlProbe(0)
    try:
        snap = probe.snapshot()
        assert snap.source == "nvml"
        assert 0 < snap.free <= snap.total
        probe.reserve(snap.free)
        assert probe.snapshot().free < snap.free
    finally:
        probe.close()


@needs_cuda
def test_torch_probe_reads_the_device() -> None:
    probe = memory.TorchProbe("cuda:0")
    snap = probe.snapshot()
    assert snap.source == "torch"
    assert 0 < snap.free <= snap.total
    assert snap.reserved_by_torch is not None


@needs_cuda
def test_make_probe_for_cuda_reads_the_device() -> None:
    probe = make_probe("cuda:0", None, 0)
    try:
        assert probe.snapshot().source in ("nvml", "torch")
    finally:
        probe.close()
