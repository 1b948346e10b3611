"""LoRA adapters on a mixture-of-experts model's routed experts (`hybridrl.models.lora`) against peft's LoRA on the
transformers model, whose experts are stacked 3-D parameters: peft loads a folder of per-expert adapters onto them
(its transformers-5 conversion: an expert's gate and up adapters one block-diagonal adapter of rank 2r on
gate_up_proj, its down adapter one on down_proj, through its ParamWrapper). The same adapter
values give the same logits (1e-5) and every adapter half's gradient as peft's exact (float64) one within 3x peft's
own float32 error, at EP1, EP2, TP2 and with each expert split over expert TP 2 (fp32, forked gloo ranks); the base
alone gives the base model's logits and gets no gradient; a sync sends each expert's weights with its adapters
merged."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.lora_adapters import RANK, adapted_model_pass, assert_plan_expects_the_folder
from tests.support.models_fixtures import VOCAB, make_hf_model, read_json, sample_tokens

TOKENS = sample_tokens(batch=2)
ALPHA = 8.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# a family's experts in its checkpoint: the MoE module, (gate, up, down), and the config key of their FFN width
EXPERTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"),
           "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size")}
# type lora: one A for a megatron layer's projections (the attention's; an expert's gate and up)
FUSED_ATTENTION = ("q_proj", "k_proj", "v_proj")


def _moe_lora_rank(rank: int, world: int, hf_dir: str, state: dict[str, torch.Tensor],
                   weights: torch.Tensor, export: str | None = None, tp: int = 1, ep: int | None = None,
                   etp: int = 1) -> dict[str, Any]:
    """EP = world / TP unless given; at TP > 1 with sequence parallelism (megatron's MoE layer trains only so); each
    expert split over `etp` ranks (1: whole on its rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as megatron_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    from hybridrl.models.lora import LoraSettings
    from hybridrl.models.lora_targets import TARGETS
    from hybridrl.parallel.device import collective_device
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=tp, ep=world // tp if ep is None else ep, etp=etp, device="cpu")
    try:
        settings = LoraSettings(rank=RANK, alpha=ALPHA, kind="lora", targets=tuple(TARGETS["lora"]), seed=5)
        result, adapters = adapted_model_pass(rank, ctx, hf_dir, settings, state, weights, TOKENS, VOCAB,
                                              export=export, sequence_parallel=tp > 1)
        experts = [a for a in adapters if a.expert is not None]
        # the expert optimizer's grad norm: the squares of the parameters megatron counts on a rank (not `shared`, and
        # no duplicate over the dense TP group by its rule), summed over the expert TP x EP x PP group: every expert
        # half once (a half held whole on each expert TP rank counted on one of them)
        norm_group = megatron_state.get_expert_tensor_model_pipeline_parallel_group()
        counted = torch.zeros((), dtype=torch.float64, device=collective_device(norm_group))
        for param in (p for a in experts for p in a.parameters()):
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, ctx.tp_group):
                counted += param.detach().double().pow(2).sum().to(counted.device)
        dist.all_reduce(counted, group=norm_group)
        result["counted_squares"] = float(counted)
        result["local_experts"] = sorted({a.expert for a in experts})
        return result
    finally:
        destroy_model_parallel()


def _per_expert_state(hf_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random adapters under per-expert names (what `lora_state` holds): the attention's fused q/k/v sharing one A,
    each expert's gate and up sharing one A; B not zero, so the adapters change the model."""
    c = read_json(hf_dir / "config.json")
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    module, (gate, up, down), ffn_key = EXPERTS[c["model_type"]]
    experts, ffn = c["num_local_experts"], c[ffn_key]
    gen = torch.Generator().manual_seed(seed)
    state = {}

    def pair(prefix: str, projections: tuple[str, ...], rows: tuple[int, ...], inputs: int) -> None:
        a = torch.randn(RANK, inputs, generator=gen) * 0.2
        for projection, out in zip(projections, rows):
            state[f"{prefix}.{projection}.lora_A.weight"] = a
            state[f"{prefix}.{projection}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.2

    for layer in range(c["num_hidden_layers"]):
        attn = f"base_model.model.model.layers.{layer}.self_attn"
        pair(attn, ("q_proj", "k_proj", "v_proj"), (heads * head_dim, kv * head_dim, kv * head_dim), hidden)
        pair(attn, ("o_proj",), (hidden,), heads * head_dim)
        for e in range(experts):
            expert = f"base_model.model.model.layers.{layer}.{module}.experts.{e}"
            pair(expert, (gate, up), (ffn, ffn), hidden)
            pair(expert, (down,), (hidden,), ffn)
    return state


def _write_peft_folder(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    """A PEFT folder of per-expert adapters written here (not by hybridrl), the form peft saved for transformers 4's
    per-expert linear layers."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": sorted({name.split(".")[-3] for name in state}), "bias": "none", "inference_mode": False}))
    return folder


def _per_expert_grads(grads: dict[str, torch.Tensor], layer: int, experts: int, ffn: int, arch: str
                      ) -> dict[str, torch.Tensor]:
    """peft's gradients of one layer's stacked expert adapters under per-expert names. peft loads an expert's gate
    and up adapters onto the stacked gate_up_proj as one adapter of rank 2r (A rows [A_gate; A_up], B block-diagonal
    [[B_gate, 0], [0, B_up]]) and its down adapter onto down_proj (rank r); its ParamWrapper lays A out expert-major
    (`reshape(E, r, in)`) and B's columns rank-major (`reshape(out, r, E)`)."""
    prefix = f"base_model.model.model.layers.{layer}.mlp.experts"  # transformers 5's module of both families
    module, (gate, up, down), _ = EXPERTS[arch]
    ours = f"base_model.model.model.layers.{layer}.{module}.experts"  # the checkpoint's, per expert
    out = {}
    for wrapper, projections in ((f"{prefix}.base_layer", (gate, up)), (prefix, (down,))):
        width = RANK * len(projections)
        a = grads[f"{wrapper}.lora_A.weight"].reshape(experts, width, -1)
        b = grads[f"{wrapper}.lora_B.weight"].reshape(-1, width, experts)
        for e in range(experts):
            for i, projection in enumerate(projections):
                rows = slice(i * ffn, (i + 1) * ffn) if len(projections) == 2 else slice(None)
                out[f"{ours}.{e}.{projection}.lora_A.weight"] = a[e, i * RANK:(i + 1) * RANK]
                out[f"{ours}.{e}.{projection}.lora_B.weight"] = b[rows, i * RANK:(i + 1) * RANK, e]
    return out


def _peft_reference(hf_dir: Path, state: dict[str, torch.Tensor], weights: torch.Tensor, folder: Path,
                    dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    import peft
    import transformers

    c = read_json(hf_dir / "config.json")
    arch, num_experts = c["model_type"], c["num_local_experts"]
    # float64: transformers' grouped-GEMM experts take fp32/bf16 only, its eager loop over experts any dtype
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager",
                                                              **experts)
    with torch.no_grad():
        base = model(TOKENS).logits
    state = {k: v.to(dtype) for k, v in state.items()}
    lora = peft.PeftModel.from_pretrained(model, _write_peft_folder(folder, state), is_trainable=True)
    assert any(".experts.base_layer.lora_A" in n for n, _ in lora.named_parameters())  # peft's stacked form
    logits = lora(TOKENS).logits
    (logits * weights.to(dtype)).sum().backward()
    grads = {n.replace(".default", ""): p.grad for n, p in lora.named_parameters() if "lora_" in n}
    out = {k: v for k, v in grads.items() if ".mlp.experts." not in k}
    for layer in range(c["num_hidden_layers"]):
        out.update(_per_expert_grads(grads, layer, num_experts, c[EXPERTS[arch][2]], arch))
    _, (gate, up, _down), _ = EXPERTS[arch]
    for projections in (FUSED_ATTENTION, (gate, up)):  # one A for a megatron layer's projections: theirs summed
        for name in list(out):
            if f".{projections[0]}.lora_A." in name:
                total = sum(out[name.replace(projections[0], p)] for p in projections)
                for p in projections:
                    out[name.replace(projections[0], p)] = total
    return {"logits": logits.detach(), "base": base, "grads": out}


@pytest.fixture(scope="module", params=list(EXPERTS))
def hf_dir(tmp_path_factory, request) -> Path:
    # every layer MoE, as Qwen3-30B-A3B: peft 0.21 loading per-expert adapters onto transformers 5's stacked experts
    # drops the adapters of a dense MLP layer among MoE layers (measured: their logits unchanged), so a mixed model
    # has no peft reference here
    layers = {"mlp_only_layers": []} if request.param == "qwen3_moe" else {}
    return make_hf_model(tmp_path_factory.mktemp("lora_moe") / request.param, request.param, seed=13, **layers)


@pytest.mark.parametrize("ep", [1, 2])
def _worst_relative_error(grads: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    return max(float((grads[name].double() - exact).abs().max()) / max(float(exact.abs().max()), 1.0)
               for name, exact in truth.items())


def _expert_squares(state: dict[str, torch.Tensor]) -> float:
    """The sum of squares of every expert's adapter parameters, each once (gate and up's one A counted once)."""
    ups = [f".{up}.lora_A." for _, (_, up, _), _ in EXPERTS.values()]
    return sum(float(t.double().pow(2).sum()) for name, t in state.items()
               if ".experts." in name and not any(up in name for up in ups))


@pytest.mark.parametrize("tp,ep,etp", [
    (1, 1, 1), (1, 2, 1), (2, 1, 1),
    (2, 1, 2),  # megatron's default at TP2: each expert split over the two TP ranks
    (2, 2, 2),  # and over EP2 on 4 ranks
    (1, 1, 2),  # expert TP over the dense DP ranks: ETP rank 1 is dense TP rank 0
])
def test_expert_adapters_equal_peft_on_the_transformers_models_stacked_experts(hf_dir, tmp_path, tp, ep, etp):
    """Against peft in float64 (the exact gradients), within 3x peft's own float32 error: the experts' sums run in
    another order in megatron (permuted tokens, each expert's matmuls apart) than in transformers (a grouped GEMM,
    peft's adapters merged into the weight first), so both float32 runs stray from the exact gradients by ~2e-5 of
    their largest entry (measured), past a flat 1e-5."""
    import math

    state = _per_expert_state(hf_dir, 3)
    weights = torch.randn(*TOKENS.shape, VOCAB, generator=torch.Generator().manual_seed(4))
    reference = _peft_reference(hf_dir, state, weights, tmp_path / "reference")
    exact = _peft_reference(hf_dir, state, weights, tmp_path / "exact", dtype=torch.float64)
    peft_error = _worst_relative_error(reference["grads"], exact["grads"])
    assert 0 < peft_error < 1e-4
    exported = tmp_path / "exported"
    world = math.lcm(tp, ep * etp)  # megatron's expert mesh (etp-ep-edp) tiles the dense one's TP x DP ranks
    results = run_ranks(_moe_lora_rank, world, str(hf_dir), state, weights, str(exported), tp, ep, etp,
                        timeout_s=300)
    experts = read_json(hf_dir / "config.json")["num_local_experts"]
    # each EP rank adapts its own experts (expert e on EP rank e // (E / EP)), and gathers every expert's; global
    # rank r is EP rank r // ETP % EP (the expert mesh's etp-ep-edp order)
    assert [r["local_experts"] for r in results] == [
        list(range(r // etp % ep * experts // ep, (r // etp % ep + 1) * experts // ep)) for r in range(world)]
    assert (reference["logits"] - reference["base"]).abs().max() > 1e-2  # the adapters change the model
    # the folder the ranks export (`save_peft_adapter`: every expert's adapters, gathered over EP), loaded by peft
    # onto the transformers model's stacked experts, gives the same logits
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, exported)(TOKENS).logits
    assert (loaded - results[0]["logits"]).abs().max() <= 1e-5
    assert_plan_expects_the_folder(exported, hf_dir, "lora")  # what `adapter_path` is checked against at plan
    for result in results:
        assert result["counted_squares"] == pytest.approx(_expert_squares(state), rel=1e-9)
        assert sorted(result["initial"]) == sorted(state)
        assert (result["logits"].double() - exact["logits"]).abs().max() <= 1e-5
        log_probs = torch.log_softmax(result["logits"].double(), dim=-1)
        assert (log_probs - torch.log_softmax(exact["logits"], dim=-1)).abs().max() <= 1e-5
        assert (result["logits"] - reference["logits"]).abs().max() <= 1e-5
        assert (result["base"] - reference["base"]).abs().max() <= 1e-5  # adapters off: the base model
        assert result["base_grads"] == []  # the base is frozen
        assert sorted(result["grads"]) == sorted(exact["grads"])
        # every data-parallel rank runs the same batch here, so an expert's adapters see its tokens from each of the
        # world / TP of them (over EP, expert TP and expert DP, the last summed by the harness as DDP would): that many
        # times the one batch's gradient (megatron's DDP divides expert gradients by the data-parallel size)
        expected = {name: grad * (world // tp if ".experts." in name else 1) for name, grad in exact["grads"].items()}
        assert _worst_relative_error(result["grads"], expected) <= 3 * peft_error


def test_a_fresh_expert_adapter_is_the_same_on_every_ep_layout(hf_dir):
    """A drawn from the expert's global index: EP1 and EP2 start from the same adapters; every expert's differs."""
    state = _per_expert_state(hf_dir, 3)
    weights = torch.zeros(*TOKENS.shape, VOCAB)
    one, two = (run_ranks(_moe_lora_rank, ep, str(hf_dir), state, weights, timeout_s=300)[0]["initial"]
                for ep in (1, 2))
    assert sorted(one) == sorted(two)
    for name in one:
        assert torch.equal(one[name], two[name]), name
    module, (gate, up, down), _ = EXPERTS[read_json(hf_dir / "config.json")["model_type"]]
    expert = f"base_model.model.model.layers.0.{module}.experts"
    a0, a1 = one[f"{expert}.0.{gate}.lora_A.weight"], one[f"{expert}.1.{gate}.lora_A.weight"]
    assert not torch.equal(a0, a1)
    assert torch.equal(a0, one[f"{expert}.0.{up}.lora_A.weight"])  # one A
    assert not one[f"{expert}.0.{down}.lora_B.weight"].any()  # B starts at 0


def _merged_expert_sync_rank(rank: int, world: int, hf_dir: str, tp: int, ep: int, etp: int, infer_tp: int,
                             state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.models.lora import LoraSettings, add_lora, load_lora_state, lora_adapters
    from hybridrl.models.lora_targets import TARGETS
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import Resharder

    initialize_model_parallel(tp=tp, ep=ep, etp=etp, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        for model in models:
            add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, kind="lora", targets=tuple(TARGETS["lora"])))
        load_lora_state(lora_adapters(models), state)
        groups = build_reshard_groups(build_training_mesh(world, tp, 1), infer_tp)
        return {"shards": Resharder(models, groups).reshard(), "gen_tp_index": groups.gen_tp_index[rank]}
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("tp,ep,etp,infer_tp", [(1, 2, 1, 1), (2, 1, 2, 1), (1, 1, 2, 2), (2, 2, 2, 2)])
def test_a_sync_sends_each_experts_weights_with_its_adapters_merged(hf_dir, tp, ep, etp, infer_tp):
    """The resharder reads each expert's weights as W + (alpha / r) B A from its adapters, whatever part of the
    expert a rank holds (at expert TP 2 each rank's rows of fc1 and columns of fc2 with its part of the adapter):
    every vLLM shard equals the shard of the checkpoint's weights with each per-expert adapter merged by hand
    (peft's merge: `PeftMerge`), within 1e-6."""
    import math

    from hybridrl.models.lora import PeftMerge
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from tests.support.models_fixtures import safetensors_state

    state = _per_expert_state(hf_dir, 8)
    world = math.lcm(tp, ep * etp)
    results = run_ranks(_merged_expert_sync_rank, world, str(hf_dir), tp, ep, etp, infer_tp, state, timeout_s=300)
    config, hf_state = read_json(hf_dir / "config.json"), safetensors_state(hf_dir)
    merge = PeftMerge.of(state, ALPHA / RANK)
    last = f".experts.{config['num_local_experts'] - 1}."  # every expert's adapters merged, under the file's names
    assert any(last in name for name in merge.weights) and set(merge.weights) <= set(hf_state)
    merged = {name: merge(name, tensor) for name, tensor in hf_state.items()}
    for result in results:
        expected, base = (hf_to_vllm_shards(weights, config, infer_tp, result["gen_tp_index"])
                          for weights in (merged, hf_state))
        assert sorted(result["shards"]) == sorted(expected)
        for name, tensor in expected.items():
            assert (result["shards"][name] - tensor).abs().max() <= 1e-6, name
        changed = [n for n, t in expected.items() if not torch.equal(t, base[n])]
        assert any("experts.w13" in n for n in changed) and any("experts.w2" in n for n in changed), changed
