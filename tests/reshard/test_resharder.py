"""The distributed resharder on real megatron-core models and real gloo process groups.

Each layout forks its ranks (`run_ranks`), builds this rank's GPTModel chunks from a tiny HF model,
reshards, and returns the produced vLLM shard and the `SyncReport`. The parent checks, per rank:
- the shard equals `hf_to_vllm_shards(HF state dict, config, infer_tp, gen_tp_index[rank])` bit for bit;
- the bytes the send/recv code counted equal the pure plan's, equal the Plan's estimate
  (`reshard_traffic`) up to the explained vocab-padding / KV-replication gap, stay within 1.05x of
  the lower bound, and are below the naive gather-everything cost;
- every peer is inside the rank's micro-DP group, and the transient buffers stay under the bucket.
The Llama model has vocab 512 (no padding on either side), so its estimate must match exactly;
the Qwen2 model (q/k/v bias, tied embeddings, vocab 200) exercises both paddings and the tied copy;
Qwen3 adds per-head q/k norms and a head_dim that is not hidden/heads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
from hybridrl.models.arch import ModelShape
from hybridrl.models.vllm_layout import vllm_padded_vocab
from hybridrl.reshard.checksums import ShardChecksumError, shard_checksums, verify_checksums
from hybridrl.reshard.layout import hf_to_vllm_shards
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, read_json, safetensors_state
from tests.support.reshard_ranks import (
    CHANGED_LAYER,
    DELIVERY_DELTA,
    DELTA,
    deliver_rank,
    reshard_rank,
)

# ---- parent side -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resharder_hf")
    return {
        # vocab 512: no padding in megatron (128 * tp for tp <= 4) nor in vLLM (64)
        "llama": make_hf_model(root / "llama", "llama", seed=3, vocab_size=512),
        "qwen2": make_hf_model(root / "qwen2", "qwen2", seed=4),
        "qwen3": make_hf_model(root / "qwen3", "qwen3", seed=5),
    }


def _padding_gap_bytes(shape: ModelShape, tp: int, element: int = 4) -> int:
    """How far the Plan's estimate (vocab split proportionally) may be from the exact plan: each vocab
    tensor's split points move by megatron's padding (to 128*tp) on the holder side and vLLM's (to 64)
    on the shard side."""
    megatron_pad = shape.padded_vocab_size(tp) - shape.vocab_size
    vllm_pad = vllm_padded_vocab(shape.vocab_size) - shape.vocab_size
    vocab_tensors = 1 if shape.tie_word_embeddings else 2
    return vocab_tensors * (megatron_pad + 2 * vllm_pad) * shape.hidden_size * element


LAYOUTS = [
    # (model, tp, pp, vpp, world, infer_tp, bucket bytes)
    ("llama", 2, 2, None, 4, 2, 16 << 10),
    ("llama", 2, 2, None, 4, 1, 512 << 20),
    ("qwen2", 2, 1, None, 2, 1, 16 << 10),
    ("qwen2", 1, 2, None, 2, 2, 512 << 20),
    ("llama", 4, 1, None, 4, 2, 32 << 10),
    ("qwen2", 2, 1, None, 4, 1, 8 << 10),  # DP2: two replicas reshard independently
    ("llama", 1, 2, 2, 2, 2, 16 << 10),  # VPP2: interleaved layers
    ("qwen3", 2, 2, None, 4, 1, 16 << 10),  # per-head q/k norms, explicit head_dim, tied
]


LAYOUTS = [(*layout, (None, None)) for layout in LAYOUTS] + [
    # uneven stages, (first, last) layers: 1 + 3, the tied copy of the embedding on the 3-layer stage
    ("qwen2", 1, 2, None, 2, 2, 16 << 10, (1, None)),
]


LAYOUT_IDS = [f"{a}-tp{t}pp{p}{'vpp' + str(v) if v else ''}{'-first' + str(s[0]) if s[0] else ''}w{w}-itp{i}"
              for a, t, p, v, w, i, _, s in LAYOUTS]


@pytest.mark.parametrize("arch,tp,pp,vpp,world,infer_tp,bucket,split", LAYOUTS, ids=LAYOUT_IDS)
def test_reshard_is_exact_and_moves_only_what_is_missing(hf_dirs, arch, tp, pp, vpp, world, infer_tp, bucket,
                                                         split):
    hf_dir = hf_dirs[arch]
    results = run_ranks(reshard_rank, world, str(hf_dir), tp, pp, vpp, infer_tp, bucket, split=split,
                        timeout_s=300)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    shape = ModelShape.from_hf_config(config)
    groups = build_reshard_groups(build_training_mesh(world, tp, pp, vpp=vpp), infer_tp)
    expected_by_index = {j: hf_to_vllm_shards(hf_state, config, infer_tp, j) for j in range(infer_tp)}
    gap = _padding_gap_bytes(shape, tp)
    for rank, result in enumerate(results):
        report, shards = result["report"], result["shards"]
        expected = expected_by_index[groups.gen_tp_index[rank]]
        assert list(shards) == list(expected), f"rank {rank}: names/order differ from vLLM's"
        for name, tensor in expected.items():
            assert shards[name].dtype == tensor.dtype and torch.equal(shards[name], tensor), f"rank {rank}: {name}"
        # checksums computed by the resharder agree with the reference shard (the 'rollout side')
        verify_checksums(report.checksums, shard_checksums(expected.items()), rank)

        received = report.bytes_received
        assert received == report.planned_bytes_received
        assert received == report.exact_lower_bound_bytes, f"rank {rank}: not the exact bound"
        assert abs(received - report.plan_bytes_received) <= gap, (rank, received, report.plan_bytes_received)
        if gap == 0:
            assert received == report.plan_bytes_received == report.plan_lower_bound_bytes
        assert received <= 1.05 * report.plan_lower_bound_bytes + gap
        # gathering everything costs more, except at infer_tp 1, where every rank needs the whole model
        assert received < report.naive_gather_bytes or (infer_tp == 1 and received == report.naive_gather_bytes)
        assert report.peers_outside_micro_dp == ()
        assert report.peak_buffer_bytes <= bucket
        assert report.generation_shard_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    # what was sent is what was received, over the whole world
    assert sum(r["report"].bytes_sent for r in results) == sum(r["report"].bytes_received for r in results)
    if bucket < 64 << 10:
        assert results[0]["report"].buckets > 1, "the small bucket should split the sync"


def test_bf16_training_weights_reshard_bit_exactly(hf_dirs):
    """bf16 parameters (the GPU default) through gloo p2p: shards equal the bf16-cast HF weights'."""
    hf_dir = hf_dirs["qwen2"]
    results = run_ranks(reshard_rank, 4, str(hf_dir), 2, 2, None, 2, 16 << 10, dtype="bfloat16", timeout_s=300)
    hf_state = {n: t.to(torch.bfloat16) for n, t in safetensors_state(hf_dir).items()}
    config = read_json(hf_dir / "config.json")
    groups = build_reshard_groups(build_training_mesh(4, 2, 2), 2)
    for rank, result in enumerate(results):
        expected = hf_to_vllm_shards(hf_state, config, 2, groups.gen_tp_index[rank])
        for name, tensor in expected.items():
            got = result["shards"][name]
            assert got.dtype == torch.bfloat16 and torch.equal(got, tensor), f"rank {rank}: {name}"
        report = result["report"]
        assert abs(report.bytes_received - report.plan_bytes_received) <= _padding_gap_bytes(
            ModelShape.from_hf_config(config), 2, element=2)


def _inconsistent_rank(rank: int, world_size: int, hf_dir: str) -> str:
    """Rank 0 is configured with another bucket size: the ranks would plan different messages."""
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    initialize_model_parallel(tp=2, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        groups = build_reshard_groups(build_training_mesh(world_size, 2, 1), 1)
        resharder = Resharder(models, groups, config=ReshardConfig(bucket_bytes=(16 if rank == 0 else 32) << 10))
        try:
            resharder.reshard()
        except ValueError as error:
            return str(error)
        return "no error"
    finally:
        destroy_model_parallel()


def test_ranks_configured_differently_fail_clearly(hf_dirs):
    messages = run_ranks(_inconsistent_rank, 2, str(hf_dirs["llama"]), timeout_s=300)
    assert "settings differ on ranks [1]" in messages[0] and "settings differ on ranks [0]" in messages[1]


def test_wrong_group_is_caught_by_checksums(hf_dirs):
    hf_dir = hf_dirs["llama"]
    results = run_ranks(reshard_rank, 4, str(hf_dir), 2, 2, None, 2, 512 << 20, swapped=True, timeout_s=300)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    groups = build_reshard_groups(build_training_mesh(4, 2, 2), 2)
    for rank, result in enumerate(results):
        intended = shard_checksums(hf_to_vllm_shards(hf_state, config, 2, groups.gen_tp_index[rank]).items())
        report = result["swapped_report"]
        with pytest.raises(ShardChecksumError) as caught:
            verify_checksums(report.checksums, intended, rank)
        # every TP-split tensor differs; only replicated norms coincide
        assert any("qkv_proj" in m.name for m in caught.value.mismatches)
        assert not any("layernorm" in m.name for m in caught.value.mismatches)
        # the wrong shard is still a correct shard of the other index: the plan itself is sound...
        other = hf_to_vllm_shards(hf_state, config, 2, 1 - groups.gen_tp_index[rank])
        assert all(torch.equal(result["swapped_shards"][n], t) for n, t in other.items())
        # ...but it costs more: ranks no longer hold the bulk of what they need
        assert report.bytes_received > result["report"].bytes_received
        assert report.peers_outside_micro_dp != ()


@pytest.mark.parametrize("keep_buffers", [False, True], ids=["fresh_buffers", "kept_buffers"])
def test_next_sync_carries_a_weight_change(hf_dirs, keep_buffers):
    hf_dir = hf_dirs["qwen2"]
    results = run_ranks(reshard_rank, 4, str(hf_dir), 2, 2, None, 2, 16 << 10, change=True,
                        keep_buffers=keep_buffers, timeout_s=300)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    changed_state = {
        name: tensor + DELTA if name.startswith(f"model.layers.{CHANGED_LAYER}.") else tensor
        for name, tensor in hf_state.items()
    }
    groups = build_reshard_groups(build_training_mesh(4, 2, 2), 2)
    for rank, result in enumerate(results):
        expected = hf_to_vllm_shards(changed_state, config, 2, groups.gen_tp_index[rank])
        before, after = result["shards"], result["changed_shards"]
        for name, tensor in expected.items():
            assert torch.equal(after[name], tensor), f"rank {rank}: {name}"
            moved = name.startswith(f"model.layers.{CHANGED_LAYER}.")
            assert moved != torch.equal(before[name], after[name]), f"rank {rank}: {name}"
        if keep_buffers:  # PP2 x TP2 -> infer TP2: every rank receives, so buffers were kept
            assert result["kept_bytes"] > 0 and result["shards_in_kept_buffers"] == []
        else:
            assert "kept_bytes" not in result


def test_kv_layout_gaps_are_exactly_the_replicated_or_regrouped_heads(hf_dirs):
    """Where the Plan's estimate (proportional slices) and the real traffic differ, by how much and why.

    Llama here: 4 query heads, 2 KV heads, head_dim 16, hidden 64, 4 layers, fp32.
    - TP4 -> infer_tp 4: megatron splits each query group [q_2g, q_2g+1, k_g, v_g] over two TP ranks
      (even rank: the two q heads; odd rank: k_g, v_g), vLLM rank r holds [q_r; k_r//2; v_r//2]. The
      estimate says nothing moves; in fact even ranks receive k,v (2 heads) and odd ranks q (1 head)
      per layer, from their neighbour — outside their (size-1) micro-DP group.
    - TP2xPP2 -> infer_tp 4: vLLM replicates each KV head on 2 ranks, so a shard holds 3 heads of
      qkv rows where the estimate's quarter of the fused rows is 2: one head more per received layer.
      vLLM's TP ranks follow the global rank (0, 1, 2, 3 = tp 0, 1, 0, 1): ranks 1 and 2 serve a quarter
      of the other training TP rank's half, so they take it from that rank's two stages (planned: the Plan's
      groups take vLLM's order).
    """
    d, h, layers, fp32 = 16, 64, 4, 4
    hf_dir = hf_dirs["llama"]
    regrouped = run_ranks(reshard_rank, 4, str(hf_dir), 4, 1, None, 4, 512 << 20, timeout_s=300)
    for rank, result in enumerate(regrouped):
        report = result["report"]
        heads_missing = 2 if rank % 2 == 0 else 1
        assert report.plan_bytes_received == 0
        assert report.bytes_received == layers * heads_missing * d * h * fp32
        assert report.peers_outside_micro_dp == (rank ^ 1,)
    replicated = run_ranks(reshard_rank, 4, str(hf_dir), 2, 2, None, 4, 512 << 20, timeout_s=300)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    groups = build_reshard_groups(build_training_mesh(4, 2, 2), 4)
    assert groups.strategy == "split"
    for rank, result in enumerate(replicated):
        report = result["report"]
        expected = hf_to_vllm_shards(hf_state, config, 4, groups.gen_tp_index[rank])
        assert all(torch.equal(result["shards"][n], t) for n, t in expected.items())
        received_layers = layers // 2 if rank in (0, 3) else layers  # the other stage's, or both stages'
        assert report.bytes_received - report.plan_bytes_received == received_layers * d * h * fp32, rank
        # peers are senders and receivers: ranks 0 and 3 send to the two that serve their quarters
        assert report.peers_outside_micro_dp == {0: (1,), 1: (0, 2), 2: (1, 3), 3: (2,)}[rank]


def test_vllm_default_groups_are_correct_but_cost_more(hf_dirs):
    """TP4 -> infer_tp 2 reshared for vLLM's consecutive TP groups instead of the Plan's strided ones:
    still bit-exact for each rank's vLLM TP rank, but ranks 1 and 2 hold none of their shard."""
    hf_dir = hf_dirs["llama"]
    results = run_ranks(reshard_rank, 4, str(hf_dir), 4, 1, None, 2, 512 << 20, vllm_default_groups=True,
                        timeout_s=300)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    received = []
    for rank, result in enumerate(results):
        expected = hf_to_vllm_shards(hf_state, config, 2, rank % 2)
        assert all(torch.equal(result["shards"][n], t) for n, t in expected.items())
        received.append(result["report"].bytes_received)
    bound = results[0]["report"].plan_lower_bound_bytes
    assert received[0] == received[3] == bound  # tp 0 and 3 hold half of their shard, as planned
    assert received[1] == received[2] > 1.5 * bound  # tp 1 holds shard-0 rows but serves vLLM TP rank 1


# ---- delivery into a live vLLM engine ------------------------------------------------------------------

LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU


DELIVERY_LAYOUTS = [
    # (model spec, tp, pp, world, infer_tp): the three layouts; Llama has ONE KV head, so
    # vLLM replicates it at infer_tp 2 while megatron splits the fused qkv.
    ("qwen2", 2, 2, 4, 2),
    ("qwen2", 2, 1, 2, 1),
    ("llama_gqa1", 1, 2, 2, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,pp,world,infer_tp", DELIVERY_LAYOUTS,
                         ids=[f"{a}-tp{t}pp{p}-itp{i}" for a, t, p, _, i in DELIVERY_LAYOUTS])
def test_sync_into_live_vllm_engine(tmp_path, arch, tp, pp, world, infer_tp):
    from tests.support.hf_generation import hf_greedy, hf_logits_of, response_rows
    from tests.support.rollout_models import LLAMA_GQA1, QWEN2_TIED, build_tiny_model, load_hf_model

    spec = {**{"qwen2": QWEN2_TIED, "llama_gqa1": LLAMA_GQA1}[arch], "eos_token_id": None, "bos_token_id": None}
    assert spec["num_hidden_layers"] % pp == 0, "a delivery layout must split the model's layers over its stages"
    hf_dir = build_tiny_model(tmp_path / arch, spec, seed=11)
    results = run_ranks(deliver_rank, world, str(hf_dir), tp, pp, infer_tp, timeout_s=600)
    model = load_hf_model(hf_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.layers.0."):
                param.add_(DELIVERY_DELTA)
    original = load_hf_model(hf_dir)
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}: {result['mismatches'][:3]}"
        assert result["report"].bytes_received == result["report"].planned_bytes_received
        moved = False
        for prompt, response, log_probs in response_rows(result["greedy"]):
            assert response == hf_greedy(model, prompt, 6), (rank, prompt)
            hf = torch.log_softmax(hf_logits_of(model, prompt, response), -1)
            expected = hf[torch.arange(len(response)), response]
            assert (log_probs.double() - expected).abs().max() <= LOGPROB_TOLERANCE
            before = torch.log_softmax(hf_logits_of(original, prompt, response), -1)
            moved |= bool((before[torch.arange(len(response)), response] - expected).abs().max() > 1e-3)
        assert moved, "the weight change did not reach the rollout engine"


def _mixed_dtype_sync_rank(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    """The hybrid worker's own set-up (megatron actor, vLLM engine, resharder, first proven sync) with
    fp32 training and a bf16 rollout: the sync's checksums must hold for vLLM's bf16 weights."""
    from hybridrl.workers.colocated import ColocatedSettings
    from tests.support.colocated_workers import colocated_worker

    # the probe's bf16 tolerance is not what this test is about: only the checksums may stop the sync
    worker = colocated_worker(rank, world_size, model_dir, [
        "actor_rollout_ref.actor.megatron.dtype=fp32", "actor_rollout_ref.rollout.dtype=bf16",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"], ColocatedSettings(probe_tolerance=1.0))
    setup = worker.setup(total_training_steps=1)
    return {"sent": worker.resharder.last_report.checksums, "held": worker.rollout.parameter_digests(),
            "train_dtype": str(worker.actor.backend.chunks[0].config.params_dtype),
            "probe": setup["reshard/probe_max_abs_gap"]}


@pytest.mark.slow
def test_bf16_rollout_from_fp32_training_syncs_with_matching_digests(tmp_path):
    from tools.make_demo_model import build

    model_dir = build("configs/models/tiny-demo/config.json", tmp_path / "model", seed=3)
    (result,) = run_ranks(_mixed_dtype_sync_rank, 1, str(model_dir), timeout_s=600)
    assert result["train_dtype"] == "torch.float32"
    hf_state, config = safetensors_state(model_dir), read_json(model_dir / "config.json")
    # independent reference: the HF weights cast to bf16, in vLLM's layout, digested
    bf16 = shard_checksums(hf_to_vllm_shards({n: t.to(torch.bfloat16) for n, t in hf_state.items()},
                                             config, 1, 0).items())
    fp32 = shard_checksums(hf_to_vllm_shards(hf_state, config, 1, 0).items())
    assert result["sent"] == bf16
    assert not set(result["sent"].values()) & set(fp32.values())  # what fp32 digests would have claimed
    verify_checksums(result["sent"], {n: result["held"][n] for n in result["sent"]}, 0)
    assert result["probe"] < 0.5  # bf16 vLLM serves the synced weights (a wrong sync gives O(1) gaps)


# ---- the pure plan at a real model's scale (no ranks) -----------------------------------------------------

QWEN2_7B_SHAPE = dict(
    architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
    intermediate_size=18944, num_hidden_layers=28, vocab_size=152064, tie_word_embeddings=False,
)


@pytest.mark.parametrize("world,tp,pp,cp,infer_tp", [(16, 4, 2, 2, 2), (32, 4, 4, 1, 4), (8, 2, 4, 1, 1),
                                                     (16, 4, 2, 1, 4)])
def test_plan_at_7b_scale_meets_the_bound_in_bounded_buckets(world, tp, pp, cp, infer_tp):
    """Qwen2-7B's shape (vocab 152064: no padding at these TPs; 4 KV heads: no replication up to infer_tp 4):
    every rank receives exactly the Plan's estimate, only from its micro-DP group and its own DP/CP
    replica, and no bucket makes any rank send + receive more than the bucket."""
    from hybridrl.config.estimates import reshard_traffic
    from hybridrl.reshard.reshard_plan import build_rank_plan

    shape = ModelShape.from_hf_config(QWEN2_7B_SHAPE)
    mesh = build_training_mesh(world, tp, pp, cp)
    groups = build_reshard_groups(mesh, infer_tp)
    traffic = reshard_traffic(shape, mesh, groups, "bf16")
    bucket_numel = (512 << 20) // 2
    for rank in range(world):
        plan = build_rank_plan(shape, mesh, groups, rank, bucket_numel=bucket_numel)
        assert plan.recv_numel * 2 == traffic.bytes_received[rank] == traffic.lower_bound[rank]
        assert plan.peers_outside_micro_dp == ()
        coord = mesh.coord(rank)
        assert all((mesh.coord(p).dp, mesh.coord(p).cp) == (coord.dp, coord.cp) for p in plan.peers)
        assert max(b.transient_numel for b in plan.buckets) <= bucket_numel
        assert plan.recv_numel < plan.naive_numel or infer_tp == 1
