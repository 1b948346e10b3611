"""How much does moving a batch through Ray cost: torch tensors vs `Batch`'s numpy transport?

Prints median wall times (ms) of ray.put, ray.get and an actor call that receives the batch, for
a dict of torch tensors (Ray's default torch serialization) and for a `Batch` (numpy out-of-band,
zero-copy on arrival). Figures, not a test: timings on shared cores are noisy, compare the ratios.

    python bench/batch_transfer.py [--mb 64] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# hybridrl.controller must import ray before anyone else does (it makes the local cluster bind to
# loopback), so ray itself is imported inside main().
from hybridrl.controller.cluster import init_ray
from hybridrl.data.batch import Batch


def make_tensors(megabytes: int) -> dict[str, torch.Tensor]:
    # A rollout-like batch: int64 token ids, float32 log-probs and a bf16 mask-sized tensor,
    # each a third of the payload.
    third = megabytes * (1 << 20) // 3
    seq = 1024
    rows = max(1, third // (seq * 8))
    return {
        "input_ids": torch.randint(0, 32000, (rows, seq), dtype=torch.int64),
        "old_log_probs": torch.randn(rows, 2 * seq, dtype=torch.float32),
        "values": torch.randn(rows, 4 * seq).to(torch.bfloat16),
    }


class Receiver:
    """Takes the batch as a (resolved) argument, as a worker does in a dispatched call."""

    def rows(self, payload) -> int:
        if isinstance(payload, Batch):
            return len(payload)
        return int(next(iter(payload.values())).shape[0])


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(name: str, payload, receiver, repeats: int) -> dict[str, float]:
    import ray

    ref = ray.put(payload)
    ray.get(ref)  # warm up
    ray.get(receiver.rows.remote(ref))
    put_ms = median_ms(lambda: ray.put(payload), repeats)
    get_ms = median_ms(lambda: ray.get(ref), repeats)
    call_ms = median_ms(lambda: ray.get(receiver.rows.remote(ref)), repeats)
    print(f"{name:<28} put {put_ms:8.1f} ms   get {get_ms:8.2f} ms   actor call (pre-put) {call_ms:8.1f} ms")
    return {"put": put_ms, "get": get_ms, "call": call_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = init_ray("local", num_cpus=2, object_store_memory=2 << 30, log_to_driver=False)
    try:
        tensors = make_tensors(args.mb)
        size_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / (1 << 20)
        print(f"payload: {size_mb:.1f} MiB in {len(tensors)} tensors, {args.repeats} repeats, median")
        import ray

        receiver = ray.remote(num_cpus=0.5)(Receiver).remote()
        torch_figures = measure("dict of torch tensors", tensors, receiver, args.repeats)
        batch_figures = measure("Batch (numpy transport)", Batch(tensors), receiver, args.repeats)
        print(
            f"ratios torch/Batch: put {torch_figures['put'] / batch_figures['put']:.1f}x, "
            f"get {torch_figures['get'] / batch_figures['get']:.0f}x, "
            f"actor call {torch_figures['call'] / batch_figures['call']:.1f}x"
        )
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
