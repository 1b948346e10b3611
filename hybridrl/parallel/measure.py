"""What one rank of this machine can do, measured with torch: matmul throughput per dtype, memory bandwidth, and the
link between two local processes (gloo: what one sends while the other sends too, and a collective's fixed time).
`hybridrl hardware --measure` writes them as a hardware description (`config.hardware`) for the plan's step-time
prediction of CPU jobs.

A CPU rank is a process with `torch_threads_per_rank` threads of the machine's cores (as `hybridrl train` runs one),
so the figures are one rank's share when `ranks` share the machine. Each figure is the best of `repeats` timings of
work large enough to leave caches (the peak the roofline divides by, as a datasheet states one).
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.parallel.device import torch_threads_per_rank


@dataclass(frozen=True)
class RankFigures:
    bf16_tflops: float
    fp32_tflops: float
    memory_gb_per_s: float
    # what each of 2 processes sends a second while receiving as much (gloo on loopback): a link's one-direction
    # figure as `config.hardware` defines it, and what the weight sync's point-to-point exchange does
    link_gb_per_s: float
    threads: int
    link_latency_us: float = 0.0  # a gloo all-reduce of 8 floats: a collective's fixed time


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timings of `work` (after one untimed warm-up)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_tflops(dtype: torch.dtype, size: int = 512, repeats: int = 5) -> float:
    """Dense matmul throughput of a `size`-square product (2 size^3 FLOPs)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e12


def memory_gb_per_s(mib: int = 256, repeats: int = 5) -> float:
    """A copy's bytes read and written per second (how a datasheet's memory bandwidth counts)."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    return 2 * source.numel() / best_seconds(lambda: target.copy_(source), repeats) / 1e9


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _link_rank(rank: int, port: int, mib: int, repeats: int, threads: int, out: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sent = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    received = torch.empty_like(sent)

    def exchange() -> None:  # both send at once, as the resharder's batched sends and receives do
        ops = [dist.P2POp(dist.isend, sent, 1 - rank), dist.P2POp(dist.irecv, received, 1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    seconds = best_seconds(exchange, repeats)
    small = torch.ones(8, dtype=torch.float32)
    # the median of many tiny all-reduces: what each collective costs whatever it moves
    latency = statistics.median(best_seconds(lambda: dist.all_reduce(small), 1) for _ in range(50 * repeats))
    dist.destroy_process_group()
    if rank == 0:
        out.put((sent.numel() * 4 / seconds / 1e9, latency * 1e6))


def link_figures(mib: int = 64, repeats: int = 5, threads: int = 1) -> tuple[float, float]:
    """(GB/s each of two fresh local processes sends while receiving as much, a gloo all-reduce's latency in µs),
    over loopback TCP: an exchange of `mib` MiB, and an all-reduce of 8 floats.

    Not an all-reduce's bus bandwidth: gloo reduces on the CPU between its sends, which a link's figure leaves out
    (the roofline counts a gradient reduction's bytes over the link, as NCCL's bus bandwidth is close to it)."""
    context = multiprocessing.get_context("spawn")  # no forked copy of this process's threads
    out = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_link_rank, args=(rank, port, mib, repeats, threads, out))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    try:
        figure = out.get(timeout=300)
    finally:
        for worker in workers:
            worker.join(timeout=60)
    failed = [worker.exitcode for worker in workers if worker.exitcode]
    if failed:
        raise RuntimeError(f"the link processes exited with {failed}")
    return float(figure[0]), float(figure[1])


def measure_rank(ranks: int, repeats: int = 5, cores: int | None = None) -> RankFigures:
    """One rank's figures when `ranks` ranks share this machine's cores (`cores`: its affinity set by default)."""
    threads = torch_threads_per_rank(ranks, cores)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bf16 = matmul_tflops(torch.bfloat16, repeats=repeats)
        fp32 = matmul_tflops(torch.float32, repeats=repeats)
        memory = memory_gb_per_s(repeats=repeats)
    finally:
        torch.set_num_threads(before)
    bandwidth, latency = link_figures(repeats=repeats, threads=threads)
    return RankFigures(bf16, fp32, memory, bandwidth, threads, latency)


def machine_name() -> str:
    """A name for this machine's description: its CPU model and core count."""
    model = "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} ({len(os.sched_getaffinity(0))} cores)"
