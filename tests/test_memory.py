"""Memory probes: the static budget and /proc/meminfo for real, the GPU probes where there is a
GPU, and the CUDA_VISIBLE_DEVICES mapping against a stand-in NVML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers import memory
from workers.memory import (
    MeminfoProbe,
    MemorySnapshot,
    StaticBudget,
    make_probe,
    parse_meminfo,
    reusable_free,
    visible_devices,
)
from zkqueue.errors import ConfigurationError

MiB = 2**20


# -- static budget ------------------------------------------------------------------------------


def test_static_budget_takes_the_weights_out() -> None:
    budget = StaticBudget(1000 * MiB, 300 * MiB)
    assert budget.snapshot() == MemorySnapshot(
        total=1000 * MiB, free=700 * MiB, device_free=700 * MiB, source="static"
    )
    budget.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_budget_refuses_non_byte_counts(bad: Any) -> None:
    with pytest.raises(ValueError):
        StaticBudget(bad)


def test_weights_larger_than_budget_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="do not fit"):
        StaticBudget(100, 101)


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
    probe.close()


def test_meminfo_probe_reads_memavailable(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\n")
    snap = MeminfoProbe(path).snapshot()
    assert (snap.total, snap.device_free, snap.free) == (1000 * 1024, 600 * 1024, 600 * 1024)


def test_meminfo_probe_falls_back_to_memfree(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\n")
    assert MeminfoProbe(path).snapshot().free == 100 * 1024


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


# -- the sizing figure on a GPU -----------------------------------------------------------------


def test_reusable_free_without_torch_figures_is_the_device_figure() -> None:
    assert reusable_free(1000, None, None) == 1000


def test_reusable_free_adds_what_torch_caches_unused() -> None:
    assert reusable_free(1000, 400, 450) == 1050
    assert reusable_free(1000, 450, 400) == 1000


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
        assert snap.device_free is not None
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
