"""MoE experts resharded from megatron's EP layout into vLLM's stacked expert parameters.

vLLM 0.32 (TP over each expert's width, its default) holds a layer's experts as
`experts.routed_experts.w13_weight` [E, 2 I / tp, H] (gate rows of rank r, then up rows) and
`w2_weight` [E, H, I / tp]. The tests compare, bit for bit:
- `hf_to_vllm_shards` with slices written here from the HF per-expert tensors;
- vLLM's own loader (engines in forked ranks; on CPU the copy taken before the pad-and-prepack step,
  `vllm_patches.capture_loaded_weights`) with the resharder's output, at training EP1 and EP2;
- the bytes each rank received with the expert slices it lacked, counted here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
from hybridrl.config.step_time import synced_tensors
from hybridrl.models.arch import ModelShape
from hybridrl.models.vllm_layout import vllm_param_shapes
from hybridrl.reshard.checksums import shard_checksums, verify_checksums
from hybridrl.reshard.layout import hf_to_vllm_shards
from hybridrl.reshard.reshard_plan import expert_domain, expert_rank_of
from tests.support import rollout_scenarios
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, read_json, safetensors_state

# HF module of the experts and the names of gate / up / down, written here independently of the tables
MOE_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_reshard")
    # max_position_embeddings: the vLLM test engines run 128-token contexts; vLLM's CPU attention
    # has no kernel for Mixtral's default head_dim here (hidden / heads = 16)
    extra = {"mixtral": {"head_dim": 32}}
    return {arch: make_hf_model(root / arch, arch, seed=40 + i, max_position_embeddings=128, **extra.get(arch, {}))
            for i, arch in enumerate(MOE_NAMES)}


def _expected_experts(hf: dict[str, torch.Tensor], arch: str, shape: ModelShape, infer_tp: int, rank: int,
                      layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    module, gate, up, down = MOE_NAMES[arch]
    width = shape.moe_ffn_hidden_size // infer_tp
    part = slice(rank * width, (rank + 1) * width)
    prefix = f"model.layers.{layer}.{module}.experts"
    w13 = torch.stack([torch.cat([hf[f"{prefix}.{e}.{gate}.weight"][part], hf[f"{prefix}.{e}.{up}.weight"][part]])
                       for e in range(shape.num_experts)])
    w2 = torch.stack([hf[f"{prefix}.{e}.{down}.weight"][:, part] for e in range(shape.num_experts)])
    return w13, w2


@pytest.mark.parametrize("arch", list(MOE_NAMES))
@pytest.mark.parametrize("infer_tp", [1, 2])
def test_expert_layout_stacks_each_experts_slice(hf_dirs, arch, infer_tp):
    hf, config = safetensors_state(hf_dirs[arch]), read_json(hf_dirs[arch] / "config.json")
    shape = ModelShape.from_hf_config(config)
    module = MOE_NAMES[arch][0]
    for rank in range(infer_tp):
        out = hf_to_vllm_shards(hf, config, infer_tp, rank)
        assert {n: tuple(t.shape) for n, t in out.items()} == vllm_param_shapes(config, infer_tp, rank)
        for layer in range(shape.num_layers):
            prefix = f"model.layers.{layer}.{module}"
            if not shape.layer_is_moe(layer):
                assert f"{prefix}.experts.routed_experts.w13_weight" not in out
                continue
            w13, w2 = _expected_experts(hf, arch, shape, infer_tp, rank, layer)
            assert torch.equal(out[f"{prefix}.experts.routed_experts.w13_weight"], w13), (rank, layer)
            assert torch.equal(out[f"{prefix}.experts.routed_experts.w2_weight"], w2), (rank, layer)
            assert torch.equal(out[f"{prefix}.gate.weight"], hf[f"{prefix}.gate.weight"])  # router: whole


def test_expert_domain_follows_megatrons_expert_mesh():
    mesh = build_training_mesh(8, 1, 1, cp=2)  # dp 4, cp 2: EP counts cp fastest, then dp
    assert [expert_rank_of(mesh, 4, dp, cp) for dp in range(4) for cp in range(2)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert expert_domain(mesh, 4, 3, 0) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert expert_domain(mesh, 1, 1, 1) == [(1, 1)]
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        expert_domain(mesh, 3, 0, 0)
    # TP1 x ETP2 x EP2 on 8 ranks: a stage's ranks repeat every lcm(1, 2 * 2) = 4, i.e. 4 replicas
    assert expert_domain(mesh, 2, 3, 1, etp=2) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert expert_domain(build_training_mesh(4, 2, 1), 1, 1, 0, etp=1) == [(1, 0)]  # TP2 x ETP1: whole experts


# ---- against real megatron and real vLLM -------------------------------------------------------------

def _moe_reshard_rank(rank: int, world_size: int, hf_dir: str, tp: int, ep: int, infer_tp: int,
                      bucket_bytes: int, etp: int | None = None, pp: int = 1, vpp: int | None = None) -> dict[str, Any]:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import ReshardConfig, Resharder

    ctx = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, device="cpu", etp=etp)
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        groups = build_reshard_groups(build_training_mesh(world_size, tp, pp), infer_tp)
        resharder = Resharder(models, groups, config=ReshardConfig(bucket_bytes=bucket_bytes))
        return {"shards": resharder.reshard(), "report": resharder.last_report, "ep_rank": ctx.ep_rank,
                "etp_rank": ctx.etp_rank, "chunks": len(models)}
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def vllm_loaded(hf_dirs):
    """What vLLM's own loader holds, per (arch, infer_tp), per TP rank (engines built on demand)."""
    cache: dict[tuple[str, int], list[dict[str, torch.Tensor]]] = {}

    def get(arch: str, infer_tp: int) -> list[dict[str, torch.Tensor]]:
        if (arch, infer_tp) not in cache:
            results = run_ranks(rollout_scenarios.layout_snapshot, infer_tp, str(hf_dirs[arch]), infer_tp,
                                timeout_s=500)
            cache[arch, infer_tp] = [r["snapshot"] for r in results]
        return cache[arch, infer_tp]

    return get


def _expert_bytes_missing(shape: ModelShape, ep: int, infer_tp: int, gen_rank: int, etp: int, etp_rank: int,
                          element: int = 4) -> int:
    """What a rank must receive for the experts: the w13 and w2 slices of its vLLM rank `gen_rank`
    (3 * H elements per column of [gen_rank * I / infer_tp, ...)) of each MoE layer's experts, less
    the columns it holds: of its EP rank's E / ep experts, those of its expert TP part
    [etp_rank * I / etp, ...); of the others none."""
    width = shape.moe_ffn_hidden_size
    want = (gen_rank * width // infer_tp, (gen_rank + 1) * width // infer_tp)
    have = (etp_rank * width // etp, (etp_rank + 1) * width // etp)
    held = max(0, min(want[1], have[1]) - max(want[0], have[0]))
    own = shape.num_experts // ep
    columns = own * (want[1] - want[0] - held) + (shape.num_experts - own) * (want[1] - want[0])
    return len(shape.moe_layers) * columns * 3 * shape.hidden_size * element


# (arch, tp, ep, expert TP (None: TP), world, infer_tp, bucket bytes)
# One xdist worker for the module: vLLM's own loader output (`vllm_loaded`) is built once per layout.
pytestmark = pytest.mark.xdist_group("reshard_moe")

MOE_LAYOUTS = [
    ("qwen3_moe", 1, 2, None, 2, 1, 16 << 10),
    ("qwen3_moe", 1, 2, None, 2, 2, 512 << 20),
    ("qwen3_moe", 2, 2, None, 4, 2, 16 << 10),  # TP2 x EP2: each expert TP-split on the megatron side
    ("qwen3_moe", 2, 2, None, 4, 1, 512 << 20),
    ("mixtral", 1, 2, None, 2, 2, 16 << 10),
    ("mixtral", 1, 2, None, 2, 1, 512 << 20),
    # TP1 x ETP2: each expert split over the two DP ranks, which then hold different halves
    ("qwen3_moe", 1, 1, 2, 2, 1, 16 << 10),
    ("qwen3_moe", 1, 1, 2, 2, 2, 512 << 20),  # each rank's half is its vLLM shard: nothing moves
    ("mixtral", 1, 1, 2, 2, 1, 512 << 20),
    # TP2 x ETP1 (verl's MoE scripts: TP 4 or 8, ETP 1): dense layers TP-split, every expert whole on its EP rank
    ("qwen3_moe", 2, 1, 1, 2, 2, 512 << 20),  # whole experts hold their vLLM halves, dense TP = infer TP: nothing moves
    ("qwen3_moe", 2, 2, 1, 4, 1, 16 << 10),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,ep,etp,world,infer_tp,bucket", MOE_LAYOUTS,
                         ids=[f"{a}-tp{t}ep{e}" + (f"etp{x}" if x else "") + f"w{w}-itp{i}"
                              for a, t, e, x, w, i, _ in MOE_LAYOUTS])
def test_resharded_experts_equal_vllms_own_loader(hf_dirs, vllm_loaded, arch, tp, ep, etp, world, infer_tp, bucket):
    from hybridrl.reshard.reshard_plan import model_rank_of

    hf_dir = hf_dirs[arch]
    results = run_ranks(_moe_reshard_rank, world, str(hf_dir), tp, ep, infer_tp, bucket, etp, timeout_s=400)
    loaded = vllm_loaded(arch, infer_tp)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    shape = ModelShape.from_hf_config(config)
    mesh = build_training_mesh(world, tp, 1)
    groups = build_reshard_groups(mesh, infer_tp)
    for rank, result in enumerate(results):
        coord = mesh.coord(rank)
        if etp is None:
            assert result["ep_rank"] == expert_rank_of(mesh, ep, coord.dp, coord.cp)
        placed = model_rank_of(mesh, rank, ep, etp)
        assert (result["ep_rank"], result["etp_rank"]) == (placed.ep_rank, placed.etp_rank)
        shards, report = result["shards"], result["report"]
        held = loaded[groups.gen_tp_index[rank]]
        assert sorted(shards) == sorted(held), f"rank {rank}: names differ from vLLM's"
        assert len(held) == synced_tensors(shape)  # the plan's count of the tensors a sync writes
        for name, tensor in held.items():
            assert shards[name].dtype == tensor.dtype and torch.equal(shards[name], tensor), f"rank {rank}: {name}"
        expected = hf_to_vllm_shards(hf_state, config, infer_tp, groups.gen_tp_index[rank])
        verify_checksums(report.checksums, shard_checksums(expected.items()), rank)
        assert report.bytes_received == report.planned_bytes_received == report.exact_lower_bound_bytes
        missing = _expert_bytes_missing(shape, ep, infer_tp, groups.gen_tp_index[rank], etp or tp,
                                        result["etp_rank"])
        if tp in (1, infer_tp):
            # dense weights: each rank already holds its vLLM shard of them (whole at tp 1, the same
            # TP part at tp = infer_tp); experts: only the slices it lacks move
            assert report.bytes_received == missing
            # the Plan's estimate (`reshard_traffic`, what `hybridrl plan` shows) counts the experts alike
            assert report.plan_bytes_received == report.plan_lower_bound_bytes == report.bytes_received
        else:  # tp 2 -> infer_tp 1: the other TP half of everything too, vocab padding aside
            assert report.bytes_received > missing
        domain = {mesh.rank_of(tp=t, cp=c, dp=d, pp=0) for d, c in expert_domain(mesh, ep, coord.dp, coord.cp, etp)
                  for t in range(tp)}
        assert set(report.peers) <= domain - {rank}
        assert report.peak_buffer_bytes <= bucket
    assert sum(r["report"].bytes_sent for r in results) == sum(r["report"].bytes_received for r in results)
    if bucket < 64 << 10 and (ep > 1 or etp):
        assert results[0]["report"].buckets > 1, "the small bucket should split the sync"


def _pipeline_need(config: dict[str, Any], infer_tp: int, shard: int, stage: int, ep: int, element: int = 4) -> int:
    """Bytes a rank of pipeline stage `stage` (of two, TP1, 1/ep of the experts of its layers held) lacks of generation
    shard `shard`: 1/infer_tp of every tensor of the other stage's layers (the model's 4 layers split 2 + 2:
    q/k/v/o, the two norms, q/k norms, the router whole, the experts or the dense MLP), and the real rows of the
    shard of the vocabulary tensor the stage lacks (the output layer and final norm on stage 0, the embedding
    on stage 1), and the shard's part of its own layers' experts held by the other EP rank; counted from the HF
    config by hand."""
    hidden, heads, kv, head_dim = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                       "head_dim"))
    experts, width, dense = config["num_local_experts"], config["moe_intermediate_size"], config["intermediate_size"]
    layers = (2, 3) if stage == 0 else (0, 1)  # the other stage's (layer 2 is dense)
    own_moe = [n for n in ((0, 1) if stage == 0 else (2, 3)) if n not in config["mlp_only_layers"]]
    total = len(own_moe) * (experts - experts // ep) * 3 * width * hidden // infer_tp
    for layer in layers:
        attention = (heads * head_dim + 2 * kv * head_dim) * hidden + heads * head_dim * hidden
        mlp = 3 * dense * hidden if layer in config["mlp_only_layers"] else 3 * experts * width * hidden
        total += (attention + mlp) // infer_tp + 2 * hidden + 2 * head_dim  # norms whole on every TP rank
        if layer not in config["mlp_only_layers"]:
            total += experts * hidden  # the router, whole
    rows = -(-config["vocab_size"] // 64) * 64 // infer_tp  # vLLM pads the vocab to a multiple of 64
    real = max(0, min(rows, config["vocab_size"] - shard * rows))
    total += real * hidden + (hidden if stage == 0 else 0)  # stage 0 lacks the output layer and final norm
    return total * element


# (pp, ep, world, infer_tp): a pipeline over the MoE model, each stage's experts split over EP at world 4
PP_MOE_LAYOUTS = [(2, 1, 2, 1), (2, 1, 2, 2), (2, 2, 4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,ep,world,infer_tp", PP_MOE_LAYOUTS,
                         ids=[f"qwen3_moe-pp{p}ep{e}w{w}-itp{i}" for p, e, w, i in PP_MOE_LAYOUTS])
def test_resharded_experts_at_pp2_equal_vllms_own_loader(hf_dirs, vllm_loaded, pp, ep, world, infer_tp):
    """issue 41 item 1, the sync half: at PP2 (and PP2 x EP2) every rank ends with exactly what vLLM's own loader
    holds for its vLLM TP rank, experts of both stages included; bytes as planned, checksums proven."""
    hf_dir = hf_dirs["qwen3_moe"]
    results = run_ranks(_moe_reshard_rank, world, str(hf_dir), 1, ep, infer_tp, 16 << 10, None, pp, timeout_s=400)
    loaded = vllm_loaded("qwen3_moe", infer_tp)
    hf_state, config = safetensors_state(hf_dir), read_json(hf_dir / "config.json")
    groups = build_reshard_groups(build_training_mesh(world, 1, pp), infer_tp)
    for rank, result in enumerate(results):
        shards, report = result["shards"], result["report"]
        held = loaded[groups.gen_tp_index[rank]]
        assert sorted(shards) == sorted(held), f"rank {rank}: names differ from vLLM's"
        for name, tensor in held.items():
            assert torch.equal(shards[name], tensor), f"rank {rank}: {name}"
        expected = hf_to_vllm_shards(hf_state, config, infer_tp, groups.gen_tp_index[rank])
        verify_checksums(report.checksums, shard_checksums(expected.items()), rank)
        # exactly the part of its generation shard it does not hold: the other stage's layers, every expert
        # of them, and the vocab rows of the embedding or output layer its stage lacks (the shards' real rows
        # differ: vLLM pads the vocab, 200 -> 2 x 128, so serving shard 0 takes 56 rows more than shard 1)
        assert report.bytes_received == report.planned_bytes_received == report.exact_lower_bound_bytes, rank
        assert report.exact_lower_bound_bytes == _pipeline_need(config, infer_tp, groups.gen_tp_index[rank],
                                                                stage=rank // (world // pp), ep=ep), rank
    assert sum(r["report"].bytes_sent for r in results) == sum(r["report"].bytes_received for r in results)


@pytest.mark.slow
def test_resharded_experts_with_virtual_pipeline_equal_vllms_own_loader(tmp_path):
    """issue 41 item 1, VPP: PP3 x VPP2 over a six-layer MoE model (each rank two one-layer chunks, experts on
    both) into infer_tp 1: every rank ends with exactly what vLLM's own loader holds, receiving exactly the four
    layers it lacks (and the vocabulary tensors of the other stages), checksums proven."""
    hf_dir = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, num_hidden_layers=6, mlp_only_layers=[2, 3],
                           max_position_embeddings=128)
    (held,) = [r["snapshot"] for r in run_ranks(rollout_scenarios.layout_snapshot, 1, str(hf_dir), 1,
                                                 timeout_s=500)]
    results = run_ranks(_moe_reshard_rank, 3, str(hf_dir), 1, 1, 1, 16 << 10, None, 3, 2, timeout_s=400)
    hf_state = safetensors_state(hf_dir)
    expected = hf_to_vllm_shards(hf_state, read_json(hf_dir / "config.json"), 1, 0)
    model_bytes = sum(t.numel() for t in hf_state.values()) * 4
    for rank, result in enumerate(results):
        assert result["chunks"] == 2
        shards, report = result["shards"], result["report"]
        assert sorted(shards) == sorted(held)
        for name, tensor in held.items():
            assert torch.equal(shards[name], tensor), f"rank {rank}: {name}"
        verify_checksums(report.checksums, shard_checksums(expected.items()), rank)
        # megatron's interleaved layout: stage s holds layers s and s + 3 (chunk 0, chunk 1)
        own = {n: t for n, t in hf_state.items() if any(f"layers.{layer}." in n for layer in (rank, rank + 3))}
        own_bytes = sum(t.numel() for t in own.values()) * 4
        vocab = {0: ("model.embed_tokens.weight",), 2: ("lm_head.weight", "model.norm.weight")}.get(rank, ())
        vocab_bytes = sum(hf_state[n].numel() for n in vocab) * 4
        assert report.bytes_received == report.exact_lower_bound_bytes == model_bytes - own_bytes - vocab_bytes, rank
    assert sum(r["report"].bytes_sent for r in results) == sum(r["report"].bytes_received for r in results)
