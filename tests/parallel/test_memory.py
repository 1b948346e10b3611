"""Memory metrics per phase: names, the /proc parser, and real figures on this CPU process."""
import mmap

import pytest
import torch

from hybridrl.parallel import memory as M

STATUS = "Name:\tpython\nVmPeak:\t 9000 kB\nVmHWM:\t  3072 kB\nVmRSS:\t  2048 kB\nThreads:\t4\n"


def test_metric_names():
    assert M.metric_names("gen_before") == ("memory/gen_before_allocated_gib", "memory/gen_before_reserved_gib")
    for bad in ("", "a/b"):
        with pytest.raises(ValueError):
            M.metric_names(bad)


def test_proc_status_parser():
    assert M.cpu_memory_bytes(STATUS) == (2048 * 1024, 3072 * 1024)
    assert M.cpu_memory_bytes("VmRSS:\t10 kB\n") == (10240, 10240)  # no peak line: the RSS twice
    with pytest.raises(ValueError, match="VmRSS"):
        M.cpu_memory_bytes("Name:\tx\n")


def test_cpu_metrics_follow_a_real_allocation():
    before = M.memory_metrics("update_before", "cpu")
    assert set(before) == {"memory/update_before_allocated_gib", "memory/update_before_reserved_gib"}
    # 64 MiB in a fresh anonymous mapping, touched so it is resident. Not a malloc'd tensor: after
    # other tests the heap can hold a free, still-resident chunk that large, and malloc reuses it
    # without the RSS moving (seen after test_parallel_cpu_matmul + test_parallel_cpu_rope).
    region = mmap.mmap(-1, 64 << 20)
    held = torch.frombuffer(region, dtype=torch.uint8)
    held.fill_(1)
    after = M.memory_metrics("update_after", "cpu")
    grown = after["memory/update_after_allocated_gib"] - before["memory/update_before_allocated_gib"]
    assert grown > 48 / 1024, grown
    assert after["memory/update_after_reserved_gib"] >= after["memory/update_after_allocated_gib"]
    del held
    region.close()


def test_unresolved_device_is_refused():
    with pytest.raises(ValueError, match="resolved device"):
        M.memory_metrics("gen_before", "auto")
