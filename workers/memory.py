"""Memory probes: how many bytes are free for the KV cache, behind one interface.

The worker reads a probe once, after the model is loaded, to size its KV cache in pages
(``workers.kvcache.size_cache``); admission then counts pages, not bytes. It reads it again only
for the figures its registration shows. ``snapshot().free`` is the sizing figure:

* ``StaticBudget``: ``total - weights``; the device is never asked (tests, CPU, or a GPU shared
  under an agreed budget).
* ``TorchProbe``/``NvmlProbe``: the device's free bytes plus the bytes torch's caching allocator
  holds without using them (this process can reuse them). The weights are already out: they are
  allocated.
* ``MeminfoProbe`` (CPU without a budget): ``MemAvailable`` from /proc/meminfo.

Choose one with ``make_probe``. Create GPU probes after the model is loaded, in the process that
runs it, so torch's figures describe this process's allocations.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from zkqueue.errors import ConfigurationError

log = logging.getLogger("zkq.memory")

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading, all in bytes. ``free`` is what the KV cache may take."""

    total: int
    free: int
    #: What the device itself says is free (before torch's reusable cache is added).
    device_free: int | None = None
    #: Device memory this process uses, where the probe can tell (NVML).
    used_by_process: int | None = None
    #: Bytes torch's caching allocator holds on the device, where torch is initialised there.
    reserved_by_torch: int | None = None
    #: Which probe took the reading ("static", "nvml", "torch", "meminfo").
    source: str = ""


class MemoryProbe(Protocol):
    """What the worker asks to size its cache and to show its memory."""

    def snapshot(self) -> MemorySnapshot:
        """Read the memory figures now."""
        ...

    def close(self) -> None:
        """Free what the probe holds (an NVML handle)."""
        ...


class StaticBudget:
    """Behave as if the device had ``total_bytes``, of which the weights take ``weights_bytes``."""

    def __init__(self, total_bytes: int, weights_bytes: int = 0) -> None:
        _check_bytes(total_bytes)
        _check_bytes(weights_bytes)
        if weights_bytes > total_bytes:
            raise ConfigurationError(
                f"the model's weights ({weights_bytes} bytes) do not fit the memory budget "
                f"({total_bytes} bytes)"
            )
        self.total_bytes = total_bytes
        self.weights_bytes = weights_bytes

    def snapshot(self) -> MemorySnapshot:
        free = self.total_bytes - self.weights_bytes
        return MemorySnapshot(total=self.total_bytes, free=free, device_free=free, source="static")

    def close(self) -> None:
        """Nothing to free."""


class TorchProbe:
    """Read a CUDA device through torch (``mem_get_info`` and the caching allocator's figures)."""

    def __init__(self, device: str = "cuda") -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigurationError(f"torch sees no CUDA device, so {device!r} cannot be probed")
        self._torch = torch
        self.device = torch.device(device)

    def snapshot(self) -> MemorySnapshot:
        device_free, total = self._torch.cuda.mem_get_info(self.device)
        allocated, cached = _torch_figures(self.device)
        return MemorySnapshot(
            total=int(total),
            free=reusable_free(int(device_free), allocated, cached),
            device_free=int(device_free),
            reserved_by_torch=cached,
            source="torch",
        )

    def close(self) -> None:
        """Nothing to free."""


class NvmlProbe:
    """Read a GPU through NVML; ``device_index`` is the CUDA index this process sees.

    The index is mapped to the physical device through CUDA_VISIBLE_DEVICES (indices or GPU-/MIG-
    UUIDs, as CUDA reads it). Integer entries are NVML (PCI bus) indices: on a host with GPUs of
    different speeds, set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA counts the same way, unless CUDA is
    already initialised in this process, in which case torch's device UUID is used.
    """

    def __init__(self, device_index: int = 0) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            self._handle = _nvml_handle(pynvml, device_index)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self.device_index = device_index
        self._closed = False

    def snapshot(self) -> MemorySnapshot:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        allocated, cached = _torch_figures(_torch_device(self.device_index))
        return MemorySnapshot(
            total=int(info.total),
            free=reusable_free(int(info.free), allocated, cached),
            device_free=int(info.free),
            used_by_process=self._process_bytes(),
            reserved_by_torch=cached,
            source="nvml",
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._nvml.nvmlShutdown()

    def _process_bytes(self) -> int | None:
        """This process's memory on the device (None inside PID namespaces that hide it)."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except self._nvml.NVMLError:
            return None
        for proc in procs:
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None


class MeminfoProbe:
    """Host memory from /proc/meminfo, so CPU workers without a budget still admit by memory."""

    def __init__(self, path: Path = MEMINFO) -> None:
        self.path = path
        self._read()  # fail now, not at the first admission, if the file is missing

    def snapshot(self) -> MemorySnapshot:
        total, available = self._read()
        return MemorySnapshot(total=total, free=available, device_free=available, source="meminfo")

    def close(self) -> None:
        """Nothing to free."""

    def _read(self) -> tuple[int, int]:
        fields = parse_meminfo(self.path.read_text())
        total = fields["MemTotal"]
        return total, fields.get("MemAvailable", fields.get("MemFree", total))


def make_probe(device: str, budget: int | None, weights_bytes: int = 0) -> MemoryProbe:
    """Pick the probe for ``device``: the static budget (of which the weights take
    ``weights_bytes``) if one is given, else NVML, else torch for CUDA devices, else
    /proc/meminfo."""
    if budget is not None:
        return StaticBudget(budget, weights_bytes)
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    if _is_cuda(device):
        return _gpu_probe(device)
    return MeminfoProbe()


def reusable_free(device_free: int, allocated: int | None, cached: int | None) -> int:
    """The device's free bytes plus what torch's caching allocator holds without using."""
    if allocated is None or cached is None:
        return device_free
    return device_free + max(0, cached - allocated)


def parse_meminfo(text: str) -> dict[str, int]:
    """The /proc/meminfo fields, in bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if parts[1:2] == ["kB"] else 1
            fields[name.strip()] = int(parts[0]) * scale
    return fields


def visible_devices(env: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: entries up to the first invalid one; None if unset."""
    if env is None:
        return None
    entries: list[str] = []
    for raw in env.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break  # CUDA ignores this entry and every one after it
        entries.append(entry)
    return entries


def _nvml_handle(nvml: Any, device_index: int) -> Any:
    """The NVML handle of the device CUDA calls ``device_index`` in this process."""
    uuid = _torch_uuid(device_index)
    if uuid is not None:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    entries = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if entries is None:
        return nvml.nvmlDeviceGetHandleByIndex(device_index)
    if not 0 <= device_index < len(entries):
        raise ConfigurationError(
            f"CUDA device {device_index} is not visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} shows {len(entries)} device(s))"
        )
    entry = entries[device_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return _handle_by_uuid(nvml, entry)


def _handle_by_uuid(nvml: Any, uuid: str) -> Any:
    """Find a device by full UUID or, as CUDA allows, by a unique UUID prefix."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError:
        pass
    matches = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        found = nvml.nvmlDeviceGetUUID(handle)
        found = found.decode() if isinstance(found, bytes) else found
        if found.startswith(uuid):
            matches.append(handle)
    if len(matches) != 1:
        raise ConfigurationError(f"CUDA_VISIBLE_DEVICES entry {uuid!r} matches {len(matches)} GPUs")
    return matches[0]


def _torch_uuid(device_index: int) -> str | None:
    """The device's UUID from torch, only where CUDA is already initialised (never initialise it
    here: a probe made before a fork must not leave a CUDA context behind)."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        return f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
    except Exception:  # an old torch without .uuid, or a device torch cannot see
        return None


def _torch_figures(device: Any) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes of torch's caching allocator, if CUDA is initialised here."""
    try:
        import torch

        if device is None or not torch.cuda.is_initialized():
            return None, None
        return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))
    except Exception:
        return None, None


def _torch_device(device_index: int) -> Any:
    try:
        import torch

        return torch.device("cuda", device_index)
    except Exception:
        return None


def _gpu_probe(device: str) -> MemoryProbe:
    index = _cuda_index(device)
    try:
        return NvmlProbe(index)
    except Exception as exc:  # no pynvml, no driver library, no such device...
        log.info("NVML probe unavailable for %s (%s); using torch", device, exc)
    return TorchProbe(f"cuda:{index}")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ConfigurationError(f"bad CUDA device {device!r}: expected cuda or cuda:N")
    return int(index) if index else 0


def _check_bytes(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a byte count must be a non-negative integer, not {n!r}")
