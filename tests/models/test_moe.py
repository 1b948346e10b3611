"""Mixture-of-experts models (Qwen3-MoE, Mixtral) through the bridge at TP/PP/EP, on real gloo groups.

Each test forks tp*pp*dp ranks, builds megatron's MoE GPTModel chunks (local spec, SequentialMLP
experts, alltoall token dispatcher) with `build_gpt_models`, loads HF weights through the layout
math (expert e on EP rank e // (experts / ep)) and runs megatron's forward-only pipeline schedule.
The parent compares the logits with transformers' eager forward, and HF -> megatron -> HF round
trips with the original files, bit for bit.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.model_passes import grads_rank, pipeline_logits
from tests.support.models_fixtures import (
    MOE_ARCHS,
    VOCAB,
    assert_same_tensors,
    checkpoint_named_grads,
    hf_logits,
    hf_model_dirs,
    make_hf_model,
    max_logit_error,
    per_file_state,
    safetensors_state,
    sample_tokens,
)

TOLERANCE = 1e-5  # max abs logits difference, fp32
TOKENS = sample_tokens(batch=2)


# ---- rank side ---------------------------------------------------------------------------------------

def _moe_rank(rank: int, world_size: int, tp: int, pp: int, ep: int, cases: list[tuple[str, str]],
              save_to: str | None = None, overrides: dict[str, dict[str, Any]] | None = None,
              etp: int | None = None) -> dict[str, Any]:
    """For each (name, HF folder): build (with `overrides[name]` on the TransformerConfig), load,
    forward; optionally save and export collectively."""
    from hybridrl.models.bridge import build_gpt_models, export_hf, load_weights, save_mcore_checkpoint
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=tp, pp=pp, ep=ep, device="cpu", etp=etp)
    out: dict[str, Any] = {"ep_rank": ctx.ep_rank, "etp_rank": ctx.etp_rank, "experts": {}, "shapes": {}}
    try:
        for name, hf_dir in cases:
            models = build_gpt_models(hf_dir, config_overrides=(overrides or {}).get(name))
            load_weights(models, hf_dir)
            out["experts"][name] = sorted(
                key for model in models for key in model.state_dict() if "local_experts" in key)
            out["shapes"][name] = {key: tuple(value.shape) for model in models
                                   for key, value in model.state_dict().items()
                                   if "local_experts" in key and value is not None}
            out[name] = pipeline_logits(models, TOKENS)
            if save_to:
                save_mcore_checkpoint(models, Path(save_to) / "mcore" / name)
                export_hf(models, Path(save_to) / "hf" / name)
    finally:
        destroy_model_parallel()
    return out


def _run(tp: int, pp: int, ep: int, cases: list[tuple[str, str]], world: int | None = None,
         **kwargs: Any) -> list[dict[str, Any]]:
    return run_ranks(_moe_rank, world or tp * pp * ep, tp, pp, ep, cases, timeout_s=400, **kwargs)


# (tp, pp, ep, etp, world): an expert TP other than TP; TP1 x ETP2 splits each expert over the two DP
# ranks, TP2 x ETP1 x EP2 keeps experts whole with the TP ranks on different EP ranks
ETP_LAYOUTS = [(1, 1, 1, 2, 2), (2, 1, 2, 1, 4), (1, 2, 1, 2, 4)]


@pytest.mark.parametrize("tp, pp, ep, etp, world", ETP_LAYOUTS)
def test_moe_logits_at_expert_tp_other_than_tp(hf_dirs, reference, tmp_path, tp, pp, ep, etp, world):
    """Each expert split over the expert TP ranks (megatron's expert mesh: expert TP rank i % etp, EP rank
    (i // etp) % ep on a stage's local rank i), the dense layers over TP: logits equal transformers';
    HF -> megatron -> HF through the live ranks' save and export is bit-exact, and the live checkpoint
    equals the offline converter's at that layout (rank files per slot)."""
    from hybridrl.models.convert_cli import main as convert_main

    cases = [(arch, str(hf_dirs[arch])) for arch in MOE_ARCHS]
    results = _run(tp, pp, ep, cases, world=world, etp=etp, save_to=str(tmp_path))
    for arch in MOE_ARCHS:
        assert max_logit_error(_last_stage_logits(results, arch), reference[arch]) <= TOLERANCE, arch
        assert_same_tensors(safetensors_state(tmp_path / "hf" / arch), safetensors_state(hf_dirs[arch]))
        offline = tmp_path / "offline" / arch
        assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs[arch]), "--out", str(offline), "--tp", str(tp),
                             "--pp", str(pp), "--ep", str(ep), "--etp", str(etp), "--quiet"]) == 0
        assert_same_tensors(per_file_state(tmp_path / "mcore" / arch), per_file_state(offline))
        back = tmp_path / "back" / arch
        assert convert_main(["mcore-to-hf", "--ckpt", str(offline), "--out", str(back), "--quiet"]) == 0
        assert_same_tensors(safetensors_state(back), safetensors_state(hf_dirs[arch]))
    experts, width = 8 // ep, 48 // etp  # qwen3_moe: 8 experts of width 48
    for r in results:
        shapes = r["shapes"]["qwen3_moe"]
        fc1 = {k: v for k, v in shapes.items() if k.endswith("linear_fc1.weight")}
        assert fc1 and len(fc1) % experts == 0 and set(fc1.values()) == {(2 * width, 64)}  # [gate; up] halves
    placed = {(r["ep_rank"], r["etp_rank"]) for r in results}
    assert placed == {(e, x) for e in range(ep) for x in range(etp)}


def _last_stage_logits(results: list[dict[str, Any]], name: str, exact: bool = True) -> torch.Tensor:
    """The logits every last-stage rank computed, the same on each (`exact`: bit for bit; else to fp32
    rounding: allgather's reduce-scatter adds the ranks' expert outputs in an order of its own per rank)."""
    found = [r[name] for r in results if r[name] is not None]
    assert found, "the last stage returns logits"
    for other in found[1:]:  # TP peers and EP/DP replicas computed the same full logits
        assert torch.equal(other, found[0]) if exact else (other - found[0]).abs().max() <= 1e-6, name
    return found[0]


# ---- parent side -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return hf_model_dirs(tmp_path_factory.mktemp("moe_hf"), MOE_ARCHS, first_seed=30)


@pytest.fixture(scope="module")
def reference(hf_dirs) -> dict[str, torch.Tensor]:
    return {arch: hf_logits(path, TOKENS) for arch, path in hf_dirs.items()}




@pytest.mark.parametrize("tp, pp, ep, dispatcher", [(1, 1, 1, "alltoall"), (1, 1, 2, "alltoall"), (2, 1, 2, "alltoall"),
                                                    (1, 2, 2, "alltoall"), (1, 1, 2, "allgather"),
                                                    (2, 1, 2, "allgather")])
def test_moe_logits_match_transformers(hf_dirs, reference, tp, pp, ep, dispatcher):
    """Either of megatron's token dispatchers (allgather: every rank gathers the TP x EP group's tokens
    and keeps its experts' share; alltoall: all-to-all over EP) gives transformers' logits."""
    cases = [(arch, str(hf_dirs[arch])) for arch in MOE_ARCHS]
    overrides = {arch: {"moe_token_dispatcher_type": dispatcher} for arch in MOE_ARCHS}
    results = _run(tp, pp, ep, cases, overrides=overrides)
    exact = dispatcher == "alltoall"
    errors = {arch: max_logit_error(_last_stage_logits(results, arch, exact), reference[arch]) for arch in MOE_ARCHS}
    assert all(err <= TOLERANCE for err in errors.values()), errors
    # Each EP rank holds its share of the experts: 8 experts over EP2 -> 4 local experts a layer.
    per_rank = {r["ep_rank"]: r["experts"]["qwen3_moe"] for r in results}
    assert sorted(per_rank) == list(range(ep))
    assert {k.split(".local_experts.")[1].split(".")[0] for k in per_rank[0]} == {str(e) for e in range(8 // ep)}


def test_moe_logits_wrong_expert_placement_is_caught(hf_dirs, reference, tmp_path):
    """Swapping two experts' weights (what a converter mixing up local and global expert indices
    does) moves the logits far outside fp32 noise: the logits test can see an expert layout error."""
    from safetensors.torch import load_file, save_file

    src = hf_dirs["qwen3_moe"]
    bad = tmp_path / "swapped"
    bad.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            (bad / p.name).write_bytes(p.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    for part in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.0.mlp.experts.{e}.{part}.weight" for e in (0, 5))
        state[a], state[b] = state[b], state[a]
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    logits = _last_stage_logits(_run(1, 1, 2, [("bad", str(bad))]), "bad")
    assert max_logit_error(logits, reference["qwen3_moe"]) > 1e-2


@pytest.mark.parametrize("tp", [1])
def test_moe_gradients_match_transformers(hf_dirs, tmp_path, tp):
    """Training sees the same model: every weight gradient (router and each expert included) equals
    HF's, mapped back by the layout math. (TP > 1: megatron's MoE layer trains only with sequence
    parallelism, which this rank function does not set up; it runs on CPU now, docs/platform.md.)"""
    import transformers

    from hybridrl.models.convert_cli import main as convert_main

    weights = torch.randn(*TOKENS.shape, VOCAB, generator=torch.Generator().manual_seed(3))
    for arch in ("qwen3_moe", "mixtral"):
        grads = tmp_path / arch / "grads"
        # the dense test's rank function: TP = world size, EP = 1
        run_ranks(grads_rank, tp, str(hf_dirs[arch]), weights, str(grads), timeout_s=300)
        assert convert_main(["mcore-to-hf", "--ckpt", str(grads), "--out", str(tmp_path / arch / "hf"),
                             "--quiet"]) == 0
        ours = safetensors_state(tmp_path / arch / "hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dirs[arch], dtype=torch.float32, attn_implementation="eager")
        (model(TOKENS).logits * weights).sum().backward()
        theirs = checkpoint_named_grads(model, arch)
        assert sorted(ours) == sorted(theirs), arch
        for name, grad in theirs.items():
            scale = grad.abs().max().item()
            assert (ours[name] - grad).abs().max().item() <= 1e-5 * max(scale, 1.0), (arch, name)


def test_moe_router_rule_matters(hf_dirs, reference):
    """The other router rule (renormalizing the top-k where HF does not, and the reverse) moves the
    logits far outside fp32 noise: the logits test can see a router mismatch."""
    cases = [("qwen3_moe", str(hf_dirs["qwen3_moe"])), ("qwen3_moe_unnormed", str(hf_dirs["qwen3_moe_unnormed"]))]
    flipped = {"qwen3_moe": {"moe_router_pre_softmax": True}, "qwen3_moe_unnormed": {"moe_router_pre_softmax": False}}
    results = _run(1, 1, 2, cases, overrides=flipped)
    for arch, _ in cases:
        assert max_logit_error(_last_stage_logits(results, arch), reference[arch]) > 1e-3, arch


@pytest.mark.parametrize("tp, pp, ep, world", [(1, 1, 2, 2), (1, 1, 2, 4), (2, 1, 2, 4), (1, 2, 2, 4)])
def test_moe_round_trip_at_ep2_is_bit_exact(hf_dirs, reference, tmp_path, tp, pp, ep, world):
    """HF -> megatron (EP2, live ranks) -> HF gives back the very tensors; the live ranks' checkpoint
    equals the offline converter's, and converting it back offline gives the HF tensors again.
    At world 4 with TP1 x EP2 each EP rank's experts have two replicas (expert DP 2): one writes."""
    from hybridrl.models.convert_cli import main as convert_main

    cases = [(arch, str(hf_dirs[arch])) for arch in MOE_ARCHS]
    results = _run(tp, pp, ep, cases, world=world, save_to=str(tmp_path))
    for arch in MOE_ARCHS:
        assert max_logit_error(_last_stage_logits(results, arch), reference[arch]) <= TOLERANCE, arch
        assert_same_tensors(safetensors_state(tmp_path / "hf" / arch), safetensors_state(hf_dirs[arch]))
        saved = tmp_path / "mcore" / arch
        assert sorted(p.name for p in saved.glob("*.safetensors")) == sorted(
            f"model_tp{t:02d}_pp{p:03d}_ep{e:03d}.safetensors"
            for t in range(tp) for p in range(pp) for e in range(ep))
        offline = tmp_path / "offline" / arch
        assert convert_main(["hf-to-mcore", "--hf", str(hf_dirs[arch]), "--out", str(offline), "--tp", str(tp),
                             "--pp", str(pp), "--ep", str(ep), "--quiet"]) == 0
        assert_same_tensors(per_file_state(saved), per_file_state(offline))
        back = tmp_path / "back" / arch
        assert convert_main(["mcore-to-hf", "--ckpt", str(saved), "--out", str(back), "--quiet"]) == 0
        assert_same_tensors(safetensors_state(back), safetensors_state(hf_dirs[arch]))


# ---- the layout math alone (no ranks) ----------------------------------------------------------------

def test_moe_shape_reads_the_config(hf_dirs):
    """ModelShape's MoE fields against transformers' own model of each config."""
    import transformers

    from hybridrl.models.arch import ModelShape

    for arch, path in hf_dirs.items():
        shape = ModelShape.from_hf_dir(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        sparse = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        assert shape.moe_layers == sparse, arch
        assert shape.param_count() == model.num_parameters(), arch
    qwen = ModelShape.from_hf_dir(hf_dirs["qwen3_moe"])
    assert (qwen.num_experts, qwen.moe_top_k, qwen.moe_ffn_hidden_size, qwen.moe_norm_topk_prob) == (8, 2, 48, True)
    assert qwen.moe_layers == (0, 1, 3)  # mlp_only_layers=[2]


@pytest.mark.parametrize("arch, top_k, norm", [(arch, top_k, norm) for arch in ("qwen3_moe", "mixtral")
                                                for top_k in (1, 2, 3) for norm in (False, True)])
def test_every_routing_the_shape_accepts_megatron_builds(tmp_path, arch, top_k, norm):
    """A routing ModelShape accepts (what the plan accepts) is one megatron-core's TransformerConfig takes: at
    top-1 megatron routes only pre-softmax, which is transformers' routing without renormalization. Top-1
    renormalized (Mixtral's always, Qwen3-MoE's with norm_topk_prob) weights the expert by 1 in transformers:
    refused, naming the field, its value and what is supported."""
    from hybridrl.models.arch import ModelShape, UnsupportedModelError, read_hf_config
    from hybridrl.models.bridge import transformer_config

    folder = make_hf_model(tmp_path, arch, num_experts_per_tok=top_k, norm_topk_prob=norm)
    renormalized = norm or arch == "mixtral"
    if top_k == 1 and renormalized:
        supported = r"num_experts_per_tok=1.*supported: num_experts_per_tok in 2\.\."
        with pytest.raises(UnsupportedModelError, match=supported):
            ModelShape.from_hf_config(read_hf_config(folder))
        return
    shape = ModelShape.from_hf_config(read_hf_config(folder))
    assert shape.moe_norm_topk_prob == renormalized
    # the GPU path's config, as the plan's megatron check builds it (no CPU stand-in installed here)
    config = transformer_config(shape, 1, 1, None, device="cuda", dtype=torch.float32, cpu_stand_ins=False)
    assert (config.moe_router_topk, config.moe_router_pre_softmax) == (top_k, not renormalized)


def test_top1_routing_without_renormalization_gives_transformers_logits(tmp_path):
    """Qwen3-MoE at top-1 with norm_topk_prob false: megatron's pre-softmax top-1 weights the expert by its
    probability over all experts, as transformers does."""
    folder = make_hf_model(tmp_path / "top1", "qwen3_moe_unnormed", num_experts_per_tok=1)
    (result,) = _run(1, 1, 1, [("top1", str(folder))])
    assert max_logit_error(result["top1"], hf_logits(folder, TOKENS)) <= TOLERANCE


def test_experts_are_placed_by_global_index(hf_dirs):
    """Expert e of a layer is local expert e - ep_rank * (experts / ep) on EP rank e // (experts / ep);
    everything else is a copy on EP ranks > 0, and the export map takes each HF tensor once."""
    from hybridrl.models.arch import ModelShape
    from hybridrl.models.layout import ParallelLayout, hf_export_map, rank_file_name, rank_tensor_plans

    shape = ModelShape.from_hf_dir(hf_dirs["qwen3_moe"])
    layout = ParallelLayout(tp=2, pp=2, ep=4)
    for ep_rank in range(4):
        plans = rank_tensor_plans(shape, layout, 1, 1, ep_rank)  # layers 2, 3: layer 2 is dense
        experts = {k: p for k, p in plans.items() if "local_experts" in k}
        assert sorted(experts) == sorted(f"decoder.layers.1.mlp.experts.local_experts.{le}.linear_fc{n}.weight"
                                         for le in range(2) for n in (1, 2))
        for local in range(2):
            fc1 = experts[f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc1.weight"]
            e = ep_rank * 2 + local
            assert fc1.hf_names == (f"model.layers.3.mlp.experts.{e}.gate_proj.weight",
                                    f"model.layers.3.mlp.experts.{e}.up_proj.weight")
            assert fc1.shape == (48, 64) and not fc1.is_copy  # [gate half r; up half r] at TP rank 1
        assert "decoder.layers.0.mlp.linear_fc1.weight" in plans  # layer 2's dense MLP
        others = [p for k, p in plans.items() if "local_experts" not in k]
        assert all(p.is_copy for p in others) == (ep_rank > 0)
    assert rank_file_name(layout, 1, 1, 3) == "model_tp01_pp001_ep003.safetensors"
    assert rank_file_name(ParallelLayout(tp=2), 1, 0) == "model_tp01_pp000.safetensors"
    pieces = hf_export_map(shape, layout)
    assert [(p.ep_rank, p.tp_rank) for p in pieces["model.layers.3.mlp.experts.5.down_proj.weight"]] == [(2, 0), (2, 1)]
    assert [(p.ep_rank, p.tp_rank) for p in pieces["model.layers.3.mlp.gate.weight"]] == [(0, 0)]


@pytest.mark.parametrize("tp, cp, dp, ep, etp", [(1, 1, 2, 1, 2), (2, 1, 2, 2, 1), (2, 1, 4, 2, 4), (4, 1, 2, 4, 2),
                                                  (2, 2, 2, 4, 1), (2, 1, 3, 3, 2), (1, 1, 4, 2, 2)])
def test_slots_are_megatrons_two_meshes(tp, cp, dp, ep, etp):
    """The layout's slot rule (local rank i of a stage: TP rank i % tp, expert TP rank i % etp, EP rank
    (i // etp) % ep, repeating every lcm(tp, etp * ep)) against megatron-core's own rank generators
    (`parallel_state.RankGenerator`, order tp-cp-ep-dp-pp, its expert mesh without CP), and each
    tensor of a slot is a copy exactly when an earlier slot holds it."""
    from megatron.core.parallel_state import RankGenerator

    from hybridrl.models.layout import ParallelLayout

    world = tp * cp * dp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=1, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep), pp=1, cp=1, order="tp-cp-ep-dp-pp")

    def rank_in(groups: list[list[int]]) -> dict[int, int]:
        return {rank: group.index(rank) for group in groups for rank in group}

    tp_rank, etp_rank, ep_rank = rank_in(dense.get_ranks("tp")), rank_in(expert.get_ranks("tp")), \
        rank_in(expert.get_ranks("ep"))
    layout = ParallelLayout(tp=tp, ep=ep, etp=etp)
    assert {layout.slot_ranks(i) for i in range(world)} == {layout.slot_ranks(s) for s in range(layout.slots)}
    for i in range(world):
        assert layout.slot_ranks(i) == (tp_rank[i], ep_rank[i], etp_rank[i]), i
        assert layout.slot_of(*layout.slot_ranks(i)) == i % layout.slots


def test_expert_tp_slots_hold_each_tensor_once(hf_dirs):
    """TP1 x ETP2: two rank files per stage; the dense tensors are copies in the second, each holds half
    of every expert's fc1 ([gate half; up half]) and fc2 (columns); the export map takes each HF tensor
    once. TP2 x ETP1 x EP2: two slots, (tp0, ep0) and (tp1, ep1), whole experts."""
    from hybridrl.models.arch import ModelShape
    from hybridrl.models.layout import ParallelLayout, hf_export_map, rank_file_name, rank_tensor_plans

    shape = ModelShape.from_hf_dir(hf_dirs["qwen3_moe"])
    layout = ParallelLayout(tp=1, etp=2)
    assert [tuple(r) for r in layout.model_ranks()] == [(0, 0, 0, 0), (0, 0, 0, 1)]
    assert [rank_file_name(layout, *r) for r in layout.model_ranks()] == [
        "model_tp00_pp000_ep000_etp00.safetensors", "model_tp00_pp000_ep000_etp01.safetensors"]
    for etp_rank in range(2):
        plans = rank_tensor_plans(shape, layout, 0, 0, 0, etp_rank)
        fc1 = plans["decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"]
        gate, up = (f"model.layers.0.mlp.experts.5.{n}_proj.weight" for n in ("gate", "up"))
        assert [(seg.hf_name, seg.start, seg.stop) for seg in fc1.segments] == [
            (gate, 24 * etp_rank, 24 * etp_rank + 24), (up, 24 * etp_rank, 24 * etp_rank + 24)]
        fc2 = plans["decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"]
        assert fc2.shape == (64, 24) and fc2.axis == 1 and not fc1.is_copy and not fc2.is_copy
        dense = [p for k, p in plans.items() if "local_experts" not in k]
        assert all(p.is_copy for p in dense) == (etp_rank == 1)
    pieces = hf_export_map(shape, layout)
    assert [(p.etp_rank, p.hf_start) for p in pieces["model.layers.0.mlp.experts.5.down_proj.weight"]] == [
        (0, 0), (1, 24)]
    assert [p.etp_rank for p in pieces["model.layers.0.mlp.gate.weight"]] == [0]
    mixed = ParallelLayout(tp=2, ep=2, etp=1)
    assert [tuple(r) for r in mixed.model_ranks()] == [(0, 0, 0, 0), (1, 0, 1, 0)]
    with pytest.raises(ValueError, match="no rank holds tp_rank=1 with ep_rank=0"):
        mixed.slot_of(1, 0, 0)
    assert ParallelLayout(tp=2, etp=2) == ParallelLayout(tp=2)  # one spelling of ETP = TP


def test_moe_parallel_errors_name_the_rule(hf_dirs):
    from hybridrl.models.arch import ModelShape

    shape = ModelShape.from_hf_dir(hf_dirs["qwen3_moe"])
    assert shape.parallel_errors(ep=3) == ["ep=3 does not divide num_experts=8"]
    assert shape.parallel_errors(tp=4, ep=2) == []  # 48 / 4, 4 heads / 4, 2 KV heads shared
    assert "the experts' intermediate size 32" in " ".join(
        ModelShape.from_hf_dir(hf_dirs["qwen3_moe_unnormed"]).parallel_errors(tp=3))


# ---- the TE layer spec's names (GPU path) -----------------------------------------------------------
# TransformerEngine does not install here, so no TE module can be built. What megatron's TE spec *is*
# can still be read: its builder (`get_gpt_decoder_block_spec(use_transformer_engine=True)`) asks a
# backend provider for each module, so a provider that hands out marker classes shows which norms the
# spec fuses into the following linear (TE's `TELayerNormColumnParallelLinear`, whose norm weight TE names
# `layer_norm_weight`) and which it keeps as a module of their own (`TENorm`, weight `weight`).

def te_spec_norm_names(monkeypatch: Any, shape: Any, pp: int, pp_rank: int) -> dict[str, str]:
    """{local-spec norm name: its name under megatron's TE spec} for the layers of stage `pp_rank`."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    from hybridrl.models.bridge import transformer_config

    class FusedNormLinear:  # TE's TELayerNormColumnParallelLinear
        pass

    class Norm:  # TE's TENorm
        pass

    class MarkerProvider(LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return FusedNormLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return Norm

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", MarkerProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", Norm, raising=False)
    # the GPU path's config (on cpu it would also install the CPU layer's RoPE stand-ins in this process)
    config = transformer_config(shape, 1, pp, None, device="cuda", dtype=torch.bfloat16)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                                       vp_stage=None, pp_rank=pp_rank)
    names = {}
    for i, layer in enumerate(block.layer_specs):
        sub, prefix = layer.submodules, f"decoder.layers.{i}."
        attention = sub.self_attention.submodules
        assert sub.input_layernorm is IdentityOp and attention.linear_qkv is FusedNormLinear
        names[prefix + "input_layernorm.weight"] = prefix + "self_attention.linear_qkv.layer_norm_weight"
        if sub.pre_mlp_layernorm is Norm:
            names[prefix + "pre_mlp_layernorm.weight"] = prefix + "pre_mlp_layernorm.weight"
        else:
            assert sub.pre_mlp_layernorm is IdentityOp and sub.mlp.submodules.linear_fc1 is FusedNormLinear
            names[prefix + "pre_mlp_layernorm.weight"] = prefix + "mlp.linear_fc1.layer_norm_weight"
    assert block.layer_norm is Norm
    return names


@pytest.mark.parametrize("pp, pp_rank", [(1, 0), (2, 1)])
def test_te_names_are_megatrons_te_spec(hf_dirs, monkeypatch, pp, pp_rank):
    """megatron's TE spec fuses the pre-MLP norm into fc1 in dense layers only; an MoE layer keeps
    `pre_mlp_layernorm` (its experts have no fused norm). `spec_tensor_name` names what the spec builds."""
    from hybridrl.models.bridge import ChunkInfo, ModelSource, spec_tensor_name
    from hybridrl.models.layout import ParallelLayout

    source = ModelSource.from_path(hf_dirs["qwen3_moe"])  # layers 0, 1, 3 MoE; 2 dense
    expected = te_spec_norm_names(monkeypatch, source.shape, pp, pp_rank)
    # layer 2, the only dense one, is in both chunks: its pre-MLP norm alone is fused
    assert [n for n in expected.values() if "linear_fc1" in n] == [f"decoder.layers.{2 - 2 * pp_rank}.mlp.linear_fc1"
                                                                   ".layer_norm_weight"]
    layout = ParallelLayout(pp=pp)
    info = ChunkInfo(source, layout, layout.chunks(4, pp_rank)[0], 0, "te")
    assert {name: spec_tensor_name(name, info) for name in expected} == expected
    local = dataclasses.replace(info, spec_kind="local")
    assert all(spec_tensor_name(name, local) == name for name in expected)


def dress_as_te(model: Any, te_names: dict[str, str]) -> None:
    """Give a built local-spec chunk the state_dict names of megatron's TE spec (`te_spec_norm_names`): each
    norm the TE spec fuses moves into its linear as `layer_norm_weight` (the same tensor), as TE holds it."""
    for local, te in te_names.items():
        if local == te:
            continue
        owner_path, _, norm = local.rpartition(".weight")[0].rpartition(".")
        layer = model.get_submodule(owner_path)
        weight = getattr(layer, norm).weight
        linear = model.get_submodule(te.rpartition(".")[0])
        setattr(layer, norm, torch.nn.Identity())
        linear.register_parameter("layer_norm_weight", weight)


def _te_named_sources_rank(rank: int, world: int, hf_dir: str, te_names: dict[str, str]) -> dict[str, Any]:
    """EP2: this rank's tensors by layout name from a local-spec model, then from the same model dressed in the
    TE spec's names, through the resharder's source reader and the value model's loader."""
    from hybridrl.config.meshes import build_training_mesh
    from hybridrl.models.bridge import build_gpt_models, chunk_info, chunk_tensors, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import training_sources
    from hybridrl.training.value_head import load_value_model

    initialize_model_parallel(ep=world, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        expected = {name: t.clone() for name, t in chunk_tensors(models[0])[1].items()}
        dress_as_te(models[0], te_names)
        models[0].hybridrl = dataclasses.replace(chunk_info(models[0]), spec_kind="te")
        sources = {n: t.clone() for n, t in training_sources(models, build_training_mesh(world, 1, 1), rank)
                   .tensors[0].items()}
        with torch.no_grad():
            for param in models[0].parameters():
                param.zero_()
        load_value_model(models, hf_dir)
        loaded = {name: t.clone() for name, t in chunk_tensors(models[0])[1].items()}
        return {"expected": expected, "sources": sources, "loaded": loaded}
    finally:
        destroy_model_parallel()


def test_te_named_moe_model_feeds_the_resharder_and_the_value_loader(hf_dirs, monkeypatch):
    """The MoE weight sync and the value model's loader on the TE spec's names, at EP2 (each rank its own
    experts): they read and write the tensors the local names stand for."""
    from hybridrl.models.arch import ModelShape

    hf_dir = hf_dirs["qwen3_moe"]
    te_names = te_spec_norm_names(monkeypatch, ModelShape.from_hf_dir(hf_dir), 1, 0)
    results = run_ranks(_te_named_sources_rank, 2, str(hf_dir), te_names, timeout_s=300)
    hf = safetensors_state(hf_dir)
    for rank, result in enumerate(results):
        expected = result["expected"]
        assert result["sources"].keys() == expected.keys()
        assert all(torch.equal(result["sources"][n], t) for n, t in expected.items()), rank
        for name, tensor in expected.items():
            if name != "output_layer.weight":  # a value model's head comes from score.weight
                assert torch.equal(result["loaded"][name], tensor), (rank, name)
    # EP rank 1 holds experts 4-7: its first local expert is HF's expert 4
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert torch.equal(results[1]["expected"][expert], hf["model.layers.0.mlp.experts.4.down_proj.weight"])


def test_moe_checkpoint_changes_expert_layout_offline(hf_dirs, tmp_path):
    """hybridrl convert re-shards experts between EP layouts (EP2 -> TP2 x PP2 x EP4 -> HF), bit-exact."""
    from hybridrl.models.convert_cli import main as convert_main

    src = hf_dirs["qwen3_moe"]
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "ep2"), "--ep", "2",
                         "--quiet"]) == 0
    assert convert_main(["mcore-to-mcore", "--ckpt", str(tmp_path / "ep2"), "--out", str(tmp_path / "ep4"),
                         "--tp", "2", "--pp", "2", "--ep", "4", "--quiet"]) == 0
    assert len(list((tmp_path / "ep4").glob("model_tp*_pp*_ep*.safetensors"))) == 16
    direct = tmp_path / "direct"
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(direct), "--tp", "2", "--pp", "2",
                         "--ep", "4", "--quiet"]) == 0
    assert_same_tensors(per_file_state(tmp_path / "ep4"), per_file_state(direct))
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "ep4"), "--out", str(tmp_path / "hf"),
                         "--quiet"]) == 0
    assert_same_tensors(safetensors_state(tmp_path / "hf"), safetensors_state(src))
    # an EP the experts do not split into is refused before anything is written
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "bad"), "--ep", "3",
                         "--quiet"]) != 0
    assert not (tmp_path / "bad").exists()
