"""The cross-pool weight sync (disaggregated rollout) on real megatron-core models and two real gloo worlds.

The trainer pool and the rollout pool are separate `run_ranks` worlds started at the same time (as
in a disaggregated run, where each pool has its own default process group); they meet only in the
stateless cross-pool group (`parallel.cross_group`). Training ranks build their megatron chunks from
a tiny HF model and send; rollout ranks hold nothing and receive. The parent checks, per rollout
rank, that the assembled shard equals `hf_to_vllm_shards(HF state dict, config, infer_tp, j)` bit for
bit and that it received exactly its shard's bytes (the least it can), once; and per training rank
that it sent only ranges it holds (the exchange reads them from its own tensors) with the sending
spread over every training rank.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.config.meshes import build_training_mesh
from hybridrl.models.arch import ModelShape
from hybridrl.models.vllm_layout import vllm_targets
from hybridrl.reshard.checksums import shard_checksums, verify_checksums
from hybridrl.reshard.cross_pool_plan import CrossPoolLayout, cross_pool_totals
from hybridrl.reshard.layout import hf_to_vllm_shards
from tests.support.forked import RankError, free_port, run_ranks
from tests.support.models_fixtures import make_hf_model, read_json, safetensors_state

TIMEOUT_S = 300.0


def _layout(hf_dir: str, tp: int, pp: int, trainer_world: int, rollout_world: int, infer_tp: int,
            ep: int = 1) -> tuple[ModelShape, CrossPoolLayout]:
    shape = ModelShape.from_hf_dir(hf_dir)
    mesh = build_training_mesh(trainer_world, tp, pp)
    return shape, CrossPoolLayout(mesh, rollout_world, infer_tp, ep=ep)


def _trainer_rank(rank: int, world: int, hf_dir: str, tp: int, pp: int, rollout_world: int, infer_tp: int,
                  port: int, bucket_bytes: int, ep: int = 1, keep_buffers: bool = False) -> Any:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress, open_store
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.cross_pool import CrossPoolSender

    _, layout = _layout(hf_dir, tp, pp, world, rollout_world, infer_tp, ep)
    address = CrossGroupAddress("127.0.0.1", port, world, rollout_world)
    store = open_store("127.0.0.1", address.size, TIMEOUT_S, port=port) if rank == 0 else None
    initialize_model_parallel(tp=tp, pp=pp, ep=ep, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        group = CrossGroup(address, rank, "gloo", TIMEOUT_S, store=store)
        sender = CrossPoolSender(models, layout, group, rank=rank, bucket_bytes=bucket_bytes, keep_buffers=keep_buffers)
        reports = [sender.send(), sender.send()]  # a second sync over the same plan
        group.close()
        return reports
    finally:
        destroy_model_parallel()


def _rollout_rank(rank: int, world: int, hf_dir: str, tp: int, pp: int, trainer_world: int, infer_tp: int,
                  port: int, bucket_bytes: int, ep: int = 1, keep_buffers: bool = False) -> Any:
    from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress
    from hybridrl.reshard.cross_pool import CrossPoolReceiver

    shape, layout = _layout(hf_dir, tp, pp, trainer_world, world, infer_tp, ep)
    address = CrossGroupAddress("127.0.0.1", port, trainer_world, world)
    group = CrossGroup(address, address.member_of_rollout(rank), "gloo", TIMEOUT_S)
    receiver = CrossPoolReceiver(shape, layout, group, rollout_rank=rank, dtype=torch.float32, device="cpu",
                                 bucket_bytes=bucket_bytes, keep_buffers=keep_buffers)
    first = dict(receiver.shards())
    report = receiver.last_report
    second = dict(receiver.shards())
    group.close()
    return {"shards": first, "again": second, "report": report, "report_again": receiver.last_report}


def run_both_pools(hf_dir: Path, tp: int, pp: int, trainer_world: int, rollout_world: int, infer_tp: int,
                   bucket_bytes: int, rollout_bucket_bytes: int | None = None, ep: int = 1,
                   keep_buffers: bool = False) -> tuple[list, list]:
    """Both worlds at once (threads), joined by one cross-pool group; per-rank results of each."""
    port = free_port()
    results: dict[str, Any] = {}

    def run(name: str, fn: Any, world: int, *args: Any) -> None:
        try:
            results[name] = run_ranks(fn, world, *args, timeout_s=TIMEOUT_S)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            results[name] = error

    threads = [
        threading.Thread(target=run, args=("trainer", _trainer_rank, trainer_world, str(hf_dir), tp, pp,
                                           rollout_world, infer_tp, port, bucket_bytes, ep, keep_buffers)),
        threading.Thread(target=run, args=("rollout", _rollout_rank, rollout_world, str(hf_dir), tp, pp,
                                           trainer_world, infer_tp, port, rollout_bucket_bytes or bucket_bytes, ep,
                                           keep_buffers)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results["trainer"], results["rollout"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross_pool_hf")
    return {
        "llama": make_hf_model(root / "llama", "llama", seed=3, vocab_size=512),
        "qwen2": make_hf_model(root / "qwen2", "qwen2", seed=4),  # tied embeddings, vocab padding
        "qwen3_moe": make_hf_model(root / "qwen3_moe", "qwen3_moe", seed=6),
    }


LAYOUTS = [
    # (model, trainer TP, PP, trainer world, rollout world, infer_tp, bucket bytes, EP, buffers kept between
    # syncs: DevicePolicy.reshard_keeps_buffers, CPU's; the second sync runs on the first's buffers)
    ("llama", 2, 1, 2, 1, 1, 16 << 10, 1, False),   # TP2 -> one TP1 replica
    ("qwen2", 1, 2, 2, 2, 2, 16 << 10, 1, True),   # PP2 (tied copy on the last stage) -> one TP2 replica
    ("llama", 1, 1, 2, 2, 1, 512 << 20, 1, True),  # DP2 -> two replicas: the sending is spread over both copies
    ("qwen2", 2, 1, 4, 2, 2, 16 << 10, 1, False),   # TP2 x DP2 -> one TP2 replica
    ("qwen3_moe", 1, 1, 2, 2, 2, 16 << 10, 2, True),  # EP2: each expert from the rank that holds it
    ("qwen3_moe", 1, 2, 4, 2, 2, 16 << 10, 2, False),  # PP2 x EP2: each stage's experts from two ranks
]
IDS = [f"{m}-tp{t}pp{p}w{w}-ep{e}-to-{r}x{i}{'-kept' if k else ''}" for m, t, p, w, r, i, _, e, k in LAYOUTS]


@pytest.mark.parametrize("arch,tp,pp,trainer_world,rollout_world,infer_tp,bucket,ep,keep", LAYOUTS, ids=IDS)
def test_cross_pool_sync_is_exact_and_each_rank_moves_its_bound(hf_dirs, arch, tp, pp, trainer_world, rollout_world,
                                                                infer_tp, bucket, ep, keep):
    hf_dir = hf_dirs[arch]
    trainers, rollouts = run_both_pools(hf_dir, tp, pp, trainer_world, rollout_world, infer_tp, bucket, ep=ep,
                                        keep_buffers=keep)
    for side in (trainers, rollouts):
        if isinstance(side, BaseException):
            raise side
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    shape, layout = _layout(str(hf_dir), tp, pp, trainer_world, rollout_world, infer_tp, ep)
    element = 4
    for rank, result in enumerate(rollouts):
        expected = hf_to_vllm_shards(hf_state, config, infer_tp, rank % infer_tp)
        for shards in (result["shards"], result["again"]):
            assert list(shards) == list(expected), f"rollout rank {rank}: names/order differ from vLLM's"
            for name, tensor in expected.items():
                assert torch.equal(shards[name], tensor), f"rollout rank {rank}: {name}"
        report = result["report"]
        verify_checksums(report.checksums, shard_checksums(expected.items()), rank)
        padding = sum(t.padding_numel for t in vllm_targets(shape, infer_tp, rank % infer_tp).values())
        real_bytes = (sum(t.numel() for t in expected.values()) - padding) * element
        # it holds nothing: it must receive its whole shard, and it receives exactly that
        assert report.bytes_received == report.planned_bytes_received == report.lower_bound_bytes == real_bytes
        assert result["report_again"].bytes_received == real_bytes
        assert report.bytes_sent == 0
        assert report.peak_buffer_bytes <= bucket
    sent = [reports[0].bytes_sent for reports in trainers]
    assert sum(sent) == sum(r["report"].bytes_received for r in rollouts)
    assert [reports[1].bytes_sent for reports in trainers] == sent
    for reports in trainers:
        assert reports[0].bytes_received == 0 and reports[0].bytes_sent == reports[0].planned_bytes_sent
    totals = cross_pool_totals(shape, layout)
    assert tuple(sent) == tuple(s * element for s in totals.sent)
    # every training rank sends (nobody idles while another sends everything), and the heaviest one
    # stays near the even split
    assert min(sent) > 0
    assert max(sent) <= 1.5 * totals.balanced_send_numel * element


def test_pools_planned_differently_fail_clearly_on_both_sides(hf_dirs):
    trainers, rollouts = run_both_pools(hf_dirs["llama"], 1, 1, 1, 1, 1, 16 << 10, rollout_bucket_bytes=32 << 10)
    for side in (trainers, rollouts):
        assert isinstance(side, RankError), side
        assert "planned the weight sync differently" in side.detail
