"""Weight-sync cost of the resharder over a grid of training -> rollout layouts (CPU, forked gloo ranks).

A random Llama of ~10M parameters (vocab 8192: no vocab padding on either side, so the Plan's
estimate is exact where the KV layout allows) is built once; for every layout the ranks build
their megatron chunks, reshard (one warm-up, then the timed sync) and report what their send/recv
code counted. Per layout the table shows bytes received per rank (max, mean), the HybridFlow lower
bound (the Plan's `reshard_traffic`), their ratio (sum over ranks; goal <= 1.05), the naive
gather-everything cost (bytes from the plan; time measured by broadcasting every megatron tensor to
every rank, without assembling or checksumming any vLLM tensor), the time inside the resharder (max
over ranks; it includes assembling the vLLM tensors and digesting them), the peak extra memory
(buffers + shard tensors not yet handed over; max over ranks) and whether every rank's shard
checksums equal `hf_to_vllm_shards` of the HF weights.

Figures, not a test: 2 shared cores, gloo over loopback (bytes cost little there, so times are
dominated by copies and by other processes on the cores); the byte columns are the result.

    python bench/reshard.py [--hidden 256] [--layers 8] [--vocab 8192] [--quick] [--moe]

`--moe`: a random Qwen3-MoE instead (8 experts of width 3 * hidden / 4, top-2, every layer MoE) over
expert-parallel layouts (`MOE_GRID`); results in `results/reshard_moe.json`.

`--cross-pool`: the disaggregated rollout's sync (`reshard.cross_pool`) over `CROSS_GRID`: the trainer
pool and the rollout pool as two gloo worlds started at once, joined by the cross-pool group. Per layout:
bytes each rollout rank received against its shard (it holds nothing: the bound), the heaviest
trainer rank's bytes sent against the even share of the total (the Plan's `cross_pool_traffic`
estimates both), the sync's time (max over members), and whether every rollout rank's digests equal
`hf_to_vllm_shards`. Results in `results/reshard_cross_pool.json`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrl.config.meshes import build_reshard_groups, build_training_mesh  # noqa: E402
from hybridrl.reshard.checksums import shard_checksums  # noqa: E402
from hybridrl.reshard.layout import hf_to_vllm_shards  # noqa: E402
from tests.support.forked import run_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "reshard.json"
MIB = 1024**2

# (tp, pp, vpp, world, infer_tp, bucket bytes, generation TP index rule)
# "plan": the Plan's ReshardGroups; "vllm-default": vLLM's own consecutive TP groups (rank % infer_tp),
# what RolloutEngine builds today with external_launcher.
GRID: list[tuple[int, int, int | None, int, int, int, str]] = [
    (2, 1, None, 2, 1, 512 * MIB, "plan"),
    (2, 2, None, 4, 2, 512 * MIB, "plan"),
    (2, 2, None, 4, 1, 512 * MIB, "plan"),
    (1, 2, None, 2, 2, 512 * MIB, "plan"),
    (1, 2, 2, 2, 2, 512 * MIB, "plan"),
    (4, 1, None, 4, 2, 512 * MIB, "plan"),
    (4, 1, None, 4, 2, 512 * MIB, "vllm-default"),
    (4, 1, None, 4, 1, 512 * MIB, "plan"),
    (2, 2, None, 4, 4, 512 * MIB, "plan"),
    (2, 2, None, 8, 2, 512 * MIB, "plan"),
    (2, 4, None, 8, 2, 512 * MIB, "plan"),
    (2, 2, None, 4, 2, 1 * MIB, "plan"),
]
QUICK = [GRID[1], GRID[5], GRID[6], GRID[11]]
# (tp, pp, vpp, world, infer_tp, bucket bytes, rule, ep): MoE at EP2 / EP4 (tp 1: on CPU megatron's MoE
# layer trains at TP 1 only; the resharder itself would take any TP)
MOE_GRID: list[tuple] = [
    (1, 1, None, 2, 1, 512 * MIB, "plan", 2),
    (1, 1, None, 2, 2, 512 * MIB, "plan", 2),
    (1, 1, None, 4, 2, 512 * MIB, "plan", 4),
    (1, 2, None, 4, 2, 512 * MIB, "plan", 2),
]


# (trainer tp, pp, trainer world, rollout world, infer_tp)
CROSS_GRID: list[tuple[int, int, int, int, int]] = [
    (1, 1, 1, 1, 1),
    (2, 1, 2, 2, 2),
    (1, 2, 2, 1, 1),
    (2, 2, 4, 2, 1),
    (1, 1, 2, 4, 2),
    (2, 1, 4, 2, 2),
]


def build_model(directory: Path, hidden: int, layers: int, vocab: int, moe: bool = False) -> dict[str, Any]:
    import transformers

    heads = hidden // 32
    if moe:
        config = transformers.Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
            max_position_embeddings=256, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=3 * hidden // 4, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        )
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory, safe_serialization=True)
        return json.loads((directory / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return json.loads((directory / "config.json").read_text())


def _rank(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, vpp: int | None, infer_tp: int,
          bucket_bytes: int, index_rule: str, ep: int = 1) -> dict[str, Any]:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, device="cpu", ep=ep)
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        groups = build_reshard_groups(build_training_mesh(world_size, tp, pp, vpp=vpp), infer_tp)
        override = tuple(r % infer_tp for r in range(world_size)) if index_rule == "vllm-default" else None
        resharder = Resharder(models, groups, config=ReshardConfig(bucket_bytes=bucket_bytes), gen_tp_index=override)
        for _ in resharder.shards():  # warm-up: gloo connections, allocator
            pass
        for _ in resharder.shards():  # timed; tensors dropped as they come, as a streaming consumer would
            pass
        report = resharder.last_report
        naive_s, naive_bytes = naive_gather_everything(models, world_size, tp, pp, vpp, ep)
        return {"report": report, "gen_tp_index": resharder.plan.gen_tp_index, "naive_s": naive_s,
                "naive_bytes": naive_bytes}
    finally:
        destroy_model_parallel()


def naive_gather_everything(models: list[Any], world_size: int, tp: int, pp: int, vpp: int | None,
                            ep: int = 1) -> tuple[float, int]:
    """The design the resharder replaces, measured: every megatron tensor (DP/CP rank 0's copy) is
    broadcast to every rank, so each holds the whole model before slicing its vLLM shard (slicing not
    timed; with EP, each expert from the DP rank of its EP rank). Returns (seconds, bytes this rank received)."""
    import torch.distributed as dist

    from hybridrl.models.layout import ParallelLayout, rank_chunk_key_prefix, rank_tensor_plans

    shape = models[0].hybridrl.source.shape
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep)
    mesh = build_training_mesh(world_size, tp, pp, vpp=vpp)
    me = dist.get_rank()
    own = {}
    for model in models:
        prefix = rank_chunk_key_prefix(layout, model.hybridrl.chunk.vp_stage)
        own.update({prefix + k: v for k, v in model.state_dict(keep_vars=True).items() if v is not None
                    and not k.endswith("_extra_state")})
    received = 0
    dist.barrier()
    started = time.perf_counter()
    for pp_rank in range(pp):
        for tp_rank, ep_rank in ((t, e) for e in range(ep) for t in range(tp)):
            # cp 1: the EP rank of DP rank d is d mod ep (megatron's expert mesh)
            src = mesh.rank_of(tp=tp_rank, cp=0, dp=ep_rank, pp=pp_rank)
            for key, plan in rank_tensor_plans(shape, layout, tp_rank, pp_rank, ep_rank).items():
                if plan.is_copy:
                    continue
                tensor = own[key].detach() if me == src else torch.empty(plan.shape, dtype=torch.float32)
                dist.broadcast(tensor, src)
                if me != src:
                    received += tensor.numel() * tensor.element_size()
    return time.perf_counter() - started, received


def run_layout(hf_dir: Path, config: dict, layout: tuple, expected: dict[tuple[int, int], dict[str, str]]) -> dict:
    tp, pp, vpp, world, infer_tp, bucket, rule, *rest = layout
    ep = rest[0] if rest else 1
    started = time.perf_counter()
    results = run_ranks(_rank, world, str(hf_dir), tp, pp, vpp, infer_tp, bucket, rule, ep, timeout_s=600)
    elapsed = time.perf_counter() - started
    reports = [r["report"] for r in results]
    key = (infer_tp, 0)
    verified = True
    for r in results:
        key = (infer_tp, r["gen_tp_index"])
        if key not in expected:
            state = expected["state"]  # type: ignore[index]
            expected[key] = shard_checksums(hf_to_vllm_shards(state, config, infer_tp, key[1]).items())
        verified &= r["report"].checksums == expected[key]
    received = [r.bytes_received for r in reports]
    bound = [r.plan_lower_bound_bytes for r in reports]
    exact_bound = [r.exact_lower_bound_bytes for r in reports]
    naive = [r.naive_gather_bytes for r in reports]
    name = f"TP{tp}xPP{pp}" + (f"xVPP{vpp}" if vpp else "") + (f"xDP{world // (tp * pp)}" if world > tp * pp else "")
    name += f"xEP{ep}" if ep > 1 else ""
    return {
        "layout": f"{name} -> infer_tp {infer_tp}",
        "grouping": f"{reports[0].strategy}" if rule == "plan" else "vllm-default",
        "world": world,
        "bucket_mib": bucket / MIB,
        "recv_max_mib": max(received) / MIB,
        "recv_mean_mib": sum(received) / world / MIB,
        "bound_max_mib": max(bound) / MIB,
        "bound_mean_mib": sum(bound) / world / MIB,
        "exact_bound_mean_mib": sum(exact_bound) / world / MIB,
        "plan_estimate_mean_mib": sum(r.plan_bytes_received for r in reports) / world / MIB,
        "ratio_to_bound": sum(received) / sum(bound) if sum(bound) else (1.0 if sum(received) == 0 else float("inf")),
        "naive_max_mib": max(naive) / MIB,
        "naive_mean_mib": sum(naive) / world / MIB,
        "naive_measured_mean_mib": sum(r["naive_bytes"] for r in results) / world / MIB,
        "naive_measured_s_max": max(r["naive_s"] for r in results),
        "generation_shard_mib": max(r.generation_shard_bytes for r in reports) / MIB,
        "sync_s_max": max(r.seconds for r in reports),
        "checksum_s_max": max(r.checksum_seconds for r in reports),
        "peak_extra_mib_max": max(r.peak_extra_bytes for r in reports) / MIB,
        "peak_buffer_mib_max": max(r.peak_buffer_bytes for r in reports) / MIB,
        "buckets": reports[0].buckets,
        "messages_max": max(r.messages_received for r in reports),
        "peers_outside_micro_dp": sum(len(r.peers_outside_micro_dp) for r in reports),
        "checksums_equal": bool(verified),
        "launch_s": elapsed,
    }


def _cross_trainer(rank: int, world: int, hf_dir: str, tp: int, pp: int, rollout_world: int, infer_tp: int,
                   port: int) -> dict[str, Any]:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress, open_store
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.cross_pool import CrossPoolSender
    from hybridrl.reshard.cross_pool_plan import CrossPoolLayout

    address = CrossGroupAddress("127.0.0.1", port, world, rollout_world)
    store = open_store("127.0.0.1", address.size, 600, port=port) if rank == 0 else None
    initialize_model_parallel(tp=tp, pp=pp, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        layout = CrossPoolLayout(build_training_mesh(world, tp, pp), rollout_world, infer_tp)
        sender = CrossPoolSender(models, layout, CrossGroup(address, rank, "gloo", 600, store=store), rank=rank)
        sender.send()  # warm-up: connections, allocator
        started = time.perf_counter()
        report = sender.send()
        return {"report": report, "seconds": time.perf_counter() - started}
    finally:
        destroy_model_parallel()


def _cross_rollout(rank: int, world: int, hf_dir: str, tp: int, pp: int, trainer_world: int, infer_tp: int,
                   port: int) -> dict[str, Any]:
    from hybridrl.models.arch import ModelShape
    from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress
    from hybridrl.reshard.cross_pool import CrossPoolReceiver
    from hybridrl.reshard.cross_pool_plan import CrossPoolLayout

    address = CrossGroupAddress("127.0.0.1", port, trainer_world, world)
    layout = CrossPoolLayout(build_training_mesh(trainer_world, tp, pp), world, infer_tp)
    receiver = CrossPoolReceiver(ModelShape.from_hf_dir(hf_dir), layout,
                                 CrossGroup(address, address.member_of_rollout(rank), "gloo", 600),
                                 rollout_rank=rank, dtype=torch.float32, device="cpu")
    for _ in receiver.shards():
        pass
    started = time.perf_counter()
    for _ in receiver.shards():  # timed; tensors dropped as they come, as vLLM's writer would
        pass
    return {"report": receiver.last_report, "seconds": time.perf_counter() - started}


def run_cross_pool(hf_dir: Path, config: dict, layout: tuple, state: dict) -> dict:
    import threading

    from hybridrl.config.estimates import cross_pool_traffic
    from hybridrl.models.arch import ModelShape
    from tests.support.forked import free_port

    tp, pp, trainer_world, rollout_world, infer_tp = layout
    port = free_port()
    results: dict[str, Any] = {}

    def run(name: str, fn: Any, world: int, *args: Any) -> None:
        results[name] = run_ranks(fn, world, *args, timeout_s=900)

    threads = [threading.Thread(target=run, args=("trainer", _cross_trainer, trainer_world, str(hf_dir), tp, pp,
                                                  rollout_world, infer_tp, port)),
               threading.Thread(target=run, args=("rollout", _cross_rollout, rollout_world, str(hf_dir), tp, pp,
                                                  trainer_world, infer_tp, port))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    trainers, rollouts = results["trainer"], results["rollout"]
    expected = {j: shard_checksums(hf_to_vllm_shards(state, config, infer_tp, j).items()) for j in range(infer_tp)}
    verified = all(r["report"].checksums == expected[q % infer_tp] for q, r in enumerate(rollouts))
    estimate = cross_pool_traffic(ModelShape.from_hf_config(config), trainer_world, rollout_world, infer_tp, "fp32")
    received = [r["report"].bytes_received for r in rollouts]
    bounds = [r["report"].lower_bound_bytes for r in rollouts]
    sent = [r["report"].bytes_sent for r in trainers]
    even = -(-sum(received) // trainer_world)
    return {
        "layout": f"tp{tp}pp{pp}w{trainer_world} -> {rollout_world // infer_tp}x tp{infer_tp}",
        "recv_max_mib": max(received) / MIB, "recv_bound_mib": max(bounds) / MIB,
        "recv_ratio": sum(received) / sum(bounds), "recv_plan_mib": max(estimate.bytes_received) / MIB,
        "sent_max_mib": max(sent) / MIB, "sent_even_mib": even / MIB,
        "sent_plan_even_mib": estimate.bytes_sent_even / MIB,
        "send_balance": max(sent) / even, "sync_s_max": max(r["seconds"] for r in trainers + rollouts),
        "checksums_equal": bool(verified),
    }


def print_cross_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'layout':<26}{'recv/rank MiB':>14}{'bound':>8}{'ratio':>7}{'plan':>8}"
              f"{'sent max MiB':>13}{'even':>8}{'max/even':>9}{'plan':>8}{'sync s':>8}  ok")
    print(f"{row['layout']:<26}{row['recv_max_mib']:>14.2f}{row['recv_bound_mib']:>8.2f}{row['recv_ratio']:>7.3f}"
          f"{row['recv_plan_mib']:>8.2f}{row['sent_max_mib']:>13.2f}{row['sent_even_mib']:>8.2f}"
          f"{row['send_balance']:>9.3f}{row['sent_plan_even_mib']:>8.2f}{row['sync_s_max']:>8.3f}  "
          f"{'yes' if row['checksums_equal'] else 'NO'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="4 layouts instead of the full grid")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE over expert-parallel layouts")
    parser.add_argument("--cross-pool", action="store_true", help="the disaggregated rollout's sync (CROSS_GRID)")
    args = parser.parse_args()
    from safetensors.torch import load_file

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "model"
        config = build_model(hf_dir, args.hidden, args.layers, args.vocab, moe=args.moe)
        state = load_file(str(hf_dir / "model.safetensors"))
        params = sum(t.numel() for t in state.values())
        family = "Qwen3-MoE" if args.moe else "Llama"
        print(f"model: {family} {params / 1e6:.1f}M params ({params * 4 / MIB:.1f} MiB fp32), "
              f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}")
        expected: dict = {"state": state}
        if args.cross_pool:
            for layout in CROSS_GRID:
                rows.append(run_cross_pool(hf_dir, config, layout, state))
                print_cross_row(rows[-1], header=len(rows) == 1)
            results = RESULTS.with_name("reshard_cross_pool.json")
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps({"model_params": params, "rows": rows}, indent=2) + "\n")
            print(f"wrote {results}")
            return
        for layout in MOE_GRID if args.moe else QUICK if args.quick else GRID:
            rows.append(run_layout(hf_dir, config, layout, expected))
            print_row(rows[-1], header=len(rows) == 1)
    digest_rates = digest_seconds_per_gib()
    print("sync checksum (parallel.digest.tensor_digest, 1 thread): "
          + ", ".join(f"{dtype} {seconds:.2f} s/GiB" for dtype, seconds in digest_rates.items()))
    results = RESULTS.with_name("reshard_moe.json") if args.moe else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"model_params": params, "hidden": args.hidden, "layers": args.layers,
                                   "vocab": args.vocab, "rows": rows, "digest_s_per_gib": digest_rates},
                                  indent=2) + "\n")
    print(f"wrote {results}")


def digest_seconds_per_gib(mib: int = 256) -> dict[str, float]:
    """Seconds one thread takes to digest a GiB of weights (a `mib`-MiB tensor, best of 3)."""
    from hybridrl.parallel.digest import tensor_digest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {}
        for dtype in (torch.float32, torch.bfloat16):
            tensor = torch.randn(mib * MIB // torch.tensor([], dtype=dtype).element_size()).to(dtype)
            tensor_digest(tensor)  # builds the position weights once
            best = min(_timed(tensor_digest, tensor) for _ in range(3))
            rates[str(dtype).removeprefix("torch.")] = round(best * 1024 / mib, 3)
        return rates
    finally:
        torch.set_num_threads(threads)


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'layout':<30}{'grouping':<14}{'recv max/mean MiB':>18}{'bound mean':>11}{'ratio':>7}"
              f"{'naive max/mean MiB':>19}{'sync s':>8}{'naive s':>8}{'peak MiB':>9}{'bkts':>5}  ok")
    print(f"{row['layout']:<30}{row['grouping']:<14}"
          f"{row['recv_max_mib']:>9.2f}/{row['recv_mean_mib']:<8.2f}{row['bound_mean_mib']:>11.2f}"
          f"{row['ratio_to_bound']:>7.3f}{row['naive_max_mib']:>10.2f}/{row['naive_mean_mib']:<8.2f}"
          f"{row['sync_s_max']:>8.3f}{row['naive_measured_s_max']:>8.3f}{row['peak_extra_mib_max']:>9.2f}"
          f"{row['buckets']:>5}  "
          f"{'yes' if row['checksums_equal'] else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
