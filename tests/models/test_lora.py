"""LoRA adapters on megatron's own layers (`hybridrl.models.lora`) against peft's LoRA on the transformers model:
the same adapter values give the same logits and the same gradient of every adapter half, at TP1, TP2 and TP2 with
sequence parallelism (fp32, forked gloo ranks); the base alone gives the base model's logits; the base gets no
gradient; A's initialisation is the same full matrix on every layout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.models.lora_targets import TARGETS
from tests.support.forked import run_ranks
from tests.support.lora_adapters import (
    RANK,
    adapted_model_pass,
    adapter_state,
    assert_plan_expects_the_folder,
    fused_grads,
    shared_a,
)
from tests.support.models_fixtures import VOCAB, make_hf_model, sample_tokens

TOKENS = sample_tokens(batch=2)
ALPHA = 8.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_rank(rank: int, world: int, hf_dir: str, sequence_parallel: bool, state: dict[str, torch.Tensor] | None,
               weights: torch.Tensor, export: str | None = None, kind: str = "canonical_lora") -> dict[str, Any]:
    from hybridrl.models.lora import LoraSettings
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=world, device="cpu")
    try:
        settings = LoraSettings(rank=RANK, alpha=ALPHA, kind=kind, targets=tuple(TARGETS[kind]), seed=5)
        result, _ = adapted_model_pass(rank, ctx, hf_dir, settings, state, weights, TOKENS, VOCAB, export=export,
                                       sequence_parallel=sequence_parallel)
        return result
    finally:
        destroy_model_parallel()


def _peft_reference(hf_dir: Path, state: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, Any]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        base = model(TOKENS).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS),
                                                      lora_dropout=0.0))
    peft.set_peft_model_state_dict(lora, state)
    logits = lora(TOKENS).logits
    (logits * weights).sum().backward()
    grads = {n.replace(".default", ""): p.grad for n, p in lora.named_parameters() if "lora_" in n}
    return {"logits": logits.detach(), "base": base, "grads": grads}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("lora") / "qwen3", "qwen3", seed=11)  # GQA, q/k norms, tied




CASES = [(1, False, "canonical_lora"), (2, False, "canonical_lora"), (2, True, "canonical_lora"), (1, False, "lora"),
         (2, True, "lora")]


@pytest.mark.parametrize("tp,sequence_parallel,kind", CASES)
def test_adapters_equal_peft_on_the_transformers_model(hf_dir, tmp_path, tp, sequence_parallel, kind):
    """...and the adapter folder the ranks export (`save_peft_adapter`), loaded by peft onto the transformers
    model, gives the same logits. A fused adapter (type lora) is peft's with the layer's projections sharing one
    A: the same logits, B's gradient rows, and A's gradient the sum of theirs."""
    import peft
    import transformers

    state = adapter_state(hf_dir, 3)
    if kind == "lora":
        state = shared_a(state)
    weights = torch.randn(*TOKENS.shape, VOCAB, generator=torch.Generator().manual_seed(4))
    reference = _peft_reference(hf_dir, state, weights)
    if kind == "lora":
        reference["grads"] = fused_grads(reference["grads"])
    exported = tmp_path / "adapter"
    results = run_ranks(_lora_rank, tp, str(hf_dir), sequence_parallel, state, weights, str(exported), kind,
                        timeout_s=300)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, exported)(TOKENS).logits
    assert (loaded - results[0]["logits"]).abs().max() <= 1e-5
    assert (reference["logits"] - reference["base"]).abs().max() > 1e-2  # the adapters change the model
    assert_plan_expects_the_folder(exported, hf_dir, kind)  # what `adapter_path` is checked against at plan
    for result in results:  # every TP rank gathers the same
        assert (result["logits"] - reference["logits"]).abs().max() <= 1e-5
        assert (result["base"] - reference["base"]).abs().max() <= 1e-5  # adapters off: the base model
        assert result["base_grads"] == []  # the base is frozen
        assert sorted(result["grads"]) == sorted(reference["grads"])
        for name, grad in reference["grads"].items():
            scale = float(grad.abs().max())
            assert scale > 0 and (result["grads"][name] - grad).abs().max() <= 1e-5 * max(scale, 1.0), name


def test_a_fresh_adapter_is_the_same_on_every_layout_and_changes_nothing(hf_dir):
    """peft's initialisation: A kaiming-uniform (|A| <= 1 / sqrt(fan_in)), B zero, so the adapted model is the base
    model; A is drawn from its global layer and projection, the same whole matrix at TP1 and TP2."""
    weights = torch.ones(*TOKENS.shape, VOCAB)
    one, two = (run_ranks(_lora_rank, tp, str(hf_dir), False, None, weights, timeout_s=300)[0] for tp in (1, 2))
    assert sorted(one["initial"]) == sorted(two["initial"])
    for name, tensor in one["initial"].items():
        assert torch.equal(tensor, two["initial"][name]), name
        if ".lora_B." in name:
            assert not tensor.any()
        else:
            assert 0 < tensor.abs().max() <= 1 / tensor.shape[1] ** 0.5
    assert torch.equal(one["logits"], one["base"])
    a_names = [n for n in one["initial"] if ".lora_A." in n]
    assert len({float(one["initial"][n].sum()) for n in a_names}) == len(a_names)  # each its own draw


def test_every_layer_draws_its_own_adapters():
    """Names that are anagrams of each other (layers 12 and 21) get different seeds: a sum of character codes gave
    them the same A."""
    from hybridrl.models.lora import adapter_seed

    names = [f"layers.{i}.{part}" for i in range(96) for part in ("self_attention.linear_qkv", "mlp.linear_fc1")]
    assert len({adapter_seed(0, name) for name in names}) == len(names)


def _merged_sync_rank(rank: int, world: int, hf_dir: str, tp: int, pp: int, infer_tp: int,
                      state: dict[str, torch.Tensor], kind: str) -> dict[str, Any]:
    from hybridrl.config.meshes import build_reshard_groups, build_training_mesh
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.models.lora import LoraSettings, add_lora, load_lora_state, lora_adapters
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.reshard.resharder import Resharder

    initialize_model_parallel(tp=tp, pp=pp, device="cpu")
    try:
        models = build_gpt_models(hf_dir)
        load_weights(models, hf_dir)
        for model in models:
            add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, kind=kind, targets=tuple(TARGETS[kind])))
        adapters = lora_adapters(models)
        load_lora_state(adapters, state)
        groups = build_reshard_groups(build_training_mesh(world, tp, pp), infer_tp)
        resharder = Resharder(models, groups)
        first = resharder.reshard()
        with torch.no_grad():  # what an optimizer step does: the adapters change in place
            for adapter in adapters:
                for b in adapter.lora_B:
                    b.mul_(-1.0)
        return {"first": first, "second": resharder.reshard(), "gen_tp_index": groups.gen_tp_index[rank]}
    finally:
        destroy_model_parallel()


def _merged_hf_state(hf_dir: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's `merge_and_unload` of the adapters onto the transformers model: its weights under HF names."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS)))
    peft.set_peft_model_state_dict(lora, state)
    merged = lora.merge_and_unload().state_dict()
    return {name: tensor for name, tensor in merged.items() if not (model.config.tie_word_embeddings
                                                                      and name == "lm_head.weight")}


@pytest.mark.parametrize("tp,pp,infer_tp,kind", [(2, 1, 1, "canonical_lora"), (1, 2, 2, "canonical_lora"),
                                                 (2, 1, 2, "lora")])
def test_a_sync_sends_the_weights_with_the_adapters_merged(hf_dir, tp, pp, infer_tp, kind):
    """The resharder reads an adapted layer's weight as W + (alpha / r) B A: every vLLM shard equals the shard of
    peft's merge_and_unload on the transformers model (1e-6), and the next sync after the adapters changed in place
    carries the change (the merged weight is not kept across syncs)."""
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from tests.support.models_fixtures import read_json

    state = adapter_state(hf_dir, 8)
    if kind == "lora":
        state = shared_a(state)
    flipped = {name: -t if ".lora_B." in name else t for name, t in state.items()}
    config = read_json(hf_dir / "config.json")
    results = run_ranks(_merged_sync_rank, tp * pp, str(hf_dir), tp, pp, infer_tp, state, kind, timeout_s=300)
    merged, merged_after = _merged_hf_state(hf_dir, state), _merged_hf_state(hf_dir, flipped)
    base = hf_to_vllm_shards(_merged_hf_state(hf_dir, {n: t * 0 for n, t in state.items()}), config, infer_tp, 0)
    for result in results:
        index = result["gen_tp_index"]
        for key, hf_state in (("first", merged), ("second", merged_after)):
            expected = hf_to_vllm_shards(hf_state, config, infer_tp, index)
            assert list(result[key]) == list(expected)
            for name, tensor in expected.items():
                assert (result[key][name] - tensor).abs().max() <= 1e-6, (key, name)
        changed = [n for n, t in result["first"].items() if n in base and not torch.equal(t, base[n])]
        assert any("qkv_proj" in n for n in changed) and any("down_proj" in n for n in changed), changed


def _reread_rank(rank: int, world: int, hf_dir: str) -> dict[str, torch.Tensor]:
    from hybridrl.models.bridge import build_gpt_model, chunk_tensors, load_weights
    from hybridrl.models.lora import LoraSettings, add_lora, merged_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(device="cpu")
    try:
        model = build_gpt_model(hf_dir)
        load_weights([model], hf_dir)
        (adapter, *_) = add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, targets=("linear_fc2",)))
        name = "decoder.layers.0.mlp.linear_fc2.weight"
        weights = merged_weights(model, chunk_tensors(model)[1])
        base = weights[name].clone()  # B is zero: the base weight
        with torch.no_grad():
            adapter.lora_B[0].fill_(0.5)
        after = weights[name].clone()  # the same tensor read again, after an in-place update
        return {"base": base, "after": after, "expected": base + 0.5 * ALPHA / RANK * adapter.lora_A[0].sum(0)}
    finally:
        destroy_model_parallel()


def test_a_merged_weight_read_again_after_an_update_is_recomputed(hf_dir):
    """MergedWeights keeps the last merged weight for the pieces read after it; an in-place update of its adapters
    (an optimizer step) makes the next read recompute it."""
    (result,) = run_ranks(_reread_rank, 1, str(hf_dir), timeout_s=120)
    assert (result["after"] - result["expected"]).abs().max() <= 1e-6
    assert (result["after"] - result["base"]).abs().max() > 1e-2
