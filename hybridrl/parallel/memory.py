"""Memory per phase: one metric shape on GPUs and CPUs.

`memory_metrics("gen_before", device)` returns
`{"memory/gen_before_allocated_gib": ..., "memory/gen_before_reserved_gib": ...}`:
  - cuda: torch's caching allocator on the current device (`memory_allocated` = live tensors,
    `memory_reserved` = what the allocator holds from the driver; vLLM's sleep mode and offloading
    show up in the second).
  - cpu: the process's resident set (allocated) and its peak (reserved: the high-water mark, the figure
    that decides whether a job fits), read from /proc/self/status, so the metrics exist in CPU runs too.

The colocated policy worker records them before and after generation, weight sync and the actor update
(`hybridrl.workers.colocated`), and returns them in the metrics those calls already return.
"""
from __future__ import annotations

from pathlib import Path

GIB = float(1 << 30)
PROC_STATUS = Path("/proc/self/status")


def metric_names(phase: str) -> tuple[str, str]:
    """The (allocated, reserved) metric names of one phase, e.g. 'sync_after'."""
    if not phase or "/" in phase:
        raise ValueError(f"phase must be a plain name like 'gen_before', got {phase!r}")
    return f"memory/{phase}_allocated_gib", f"memory/{phase}_reserved_gib"


def _proc_status_kib(field: str, status_text: str) -> int | None:
    for line in status_text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # "VmRSS:   123456 kB"
    return None


def cpu_memory_bytes(status_text: str | None = None) -> tuple[int, int]:
    """(resident, peak resident) bytes of this process; `status_text` replaces /proc/self/status in tests."""
    if status_text is None:
        if not PROC_STATUS.exists():  # not Linux: psutil's figure has no peak, report it twice
            import psutil

            rss = int(psutil.Process().memory_info().rss)
            return rss, rss
        status_text = PROC_STATUS.read_text()
    rss = _proc_status_kib("VmRSS", status_text)
    peak = _proc_status_kib("VmHWM", status_text)
    if rss is None:
        raise ValueError("no VmRSS line in the process status")
    return rss * 1024, (peak if peak is not None else rss) * 1024


def memory_metrics(phase: str, device: str) -> dict[str, float]:
    """`memory/<phase>_allocated_gib` and `memory/<phase>_reserved_gib` for a resolved device."""
    allocated_name, reserved_name = metric_names(phase)
    if device == "cuda":
        import torch

        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    elif device == "cpu":
        allocated, reserved = cpu_memory_bytes()
    else:
        raise ValueError(f"memory_metrics expects a resolved device 'cuda' or 'cpu', got {device!r}")
    return {allocated_name: allocated / GIB, reserved_name: reserved / GIB}
