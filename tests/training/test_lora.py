"""A LoRA actor's PPO step (`actor_rollout_ref.model.lora`) against peft on the transformers model, and what the
frozen base costs: the same loss terms, metrics and adapter gradients as peft's (adapters read from a folder peft
itself wrote), the base untouched, the optimizer and DDP's buffers holding the adapters alone; the reference is
the base with the adapters off (one model in memory)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.models.lora_targets import PROJECTIONS as LAYER_PROJECTIONS
from hybridrl.models.lora_targets import TARGETS
from tests.support.actor_reference import (
    CASES,
    GRAD_RTOL,
    POLICY,
    SCALAR_RTOL,
    actor_config,
    ppo_batch,
    reference_step,
)
from tests.support.forked import run_ranks
from tests.support.lora_adapters import fused_grads, shared_a
from tests.support.rollout_models import build_tiny_model

RANK, ALPHA = 4, 8.0
# bf16's rounding (8 bits of mantissa) in the base's matmuls, on both sides
BF16_GRAD_RTOL, BF16_SCALAR_RTOL = 1e-1, 2e-2
HF_PROJECTIONS = [p for projections in LAYER_PROJECTIONS.values() for p in projections]


def _peft_adapter(hf: Path, folder: Path, fused: bool) -> None:
    """Random adapters (B not zero) saved by peft's own `save_pretrained`; for a fused (type lora) adapter the
    projections of one megatron layer share their A."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_PROJECTIONS))
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    if fused:
        peft.set_peft_model_state_dict(lora, shared_a(peft.get_peft_model_state_dict(lora)))
    lora.save_pretrained(folder)


def _peft_model(hf: Path, folder: Path) -> Any:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(base, folder, is_trainable=True)


def _lora_step_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import model_tensors
    from hybridrl.models.lora import adapters_disabled, lora_adapters, lora_state
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    adapters = lora_adapters(backend.chunks)
    # by (chunk, local name): under VPP a rank's chunks reuse the same local layer names
    base_before = {(i, n): t.detach().clone() for i, c in enumerate(backend.chunks)
                   for n, t in model_tensors(c).items()}
    adapters_before = lora_state(adapters)
    local = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
    with torch.no_grad(), adapters_disabled(backend.chunks):  # the reference: the base, adapters off
        base_log_probs = actor.compute_log_prob(local)
    metrics = actor.update_policy(local)
    for adapter in adapters:  # DDP's reduced gradient, read by lora_state(grads=True)
        for param in adapter.parameters():
            param.grad = param.main_grad
    trainable = [p for c in backend.chunks for p in c.parameters() if p.requires_grad]
    optimized = [p for group in backend.optimizer.param_groups for p in group["params"]]
    return {
        "metrics": metrics, "grads": lora_state(adapters, grads=True),
        "before": adapters_before, "after": lora_state(adapters),
        "base_changed": [n for i, c in enumerate(backend.chunks) for n, t in model_tensors(c).items()
                         if not torch.equal(t.detach(), base_before[(i, n)])],
        "trainable": sum(p.numel() for p in trainable),
        "adapter_numel": sum(p.numel() for a in adapters for p in a.parameters()),
        "optimized": sum(p.numel() for p in optimized),
        "ddp_buffers": sum(b.grad_data.numel() for m in backend.models for g in m.bucket_groups for b in g.buckets),
        "base_log_probs": base_log_probs["old_log_probs"] if base_log_probs is not None else None,
        # an adapter's product on a bf16 input (what a bf16 base hands it): computed in fp32
        "delta_dtype": str(adapters[0].delta(torch.zeros(2, adapters[0].lora_A[0].shape[1], dtype=torch.bfloat16,
                                                          device=adapters[0].lora_A[0].device)).dtype),
        "dtypes": {"base": {str(t.dtype) for (_, n), t in base_before.items() if "layernorm" not in n},
                   "adapters": {str(p.dtype) for a in adapters for p in a.parameters()}},
    }


def _strict_lora_step_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    """`_lora_step_rank` under strict-device mode from the start (`hybridrl.parallel.cpu.strict_device`): a host
    tensor next to a device one, or in a collective NCCL would run, raises as it would on CUDA."""
    from hybridrl.parallel.cpu import strict_device

    strict_device.enable_strict_device()
    return _lora_step_rank(rank, world, config, batch)


@pytest.mark.parametrize("kind,tp,pp,dp,cp,vpp,recompute", [
    ("canonical_lora", 2, 1, 2, 1, None, False), ("lora", 1, 2, 1, 1, None, True), ("lora", 1, 1, 1, 2, None, False),
    ("lora", 1, 3, 1, 1, 2, False)], ids=["tp2-dp2-canonical", "pp2-fused-recompute", "cp2-fused", "pp3-vpp2-fused"])
def test_a_lora_actor_step_equals_peft(tmp_path, kind, tp, pp, dp, cp, vpp, recompute):
    """Interleaved pipelines (VPP) need a trained PP > 2: 6 layers, one per model chunk. `recompute`: with
    `model.enable_gradient_checkpointing` (verl's LoRA scripts set it), megatron's full recompute, whose first stage
    gets its gradients only if the frozen embedding's output is marked as needing one (`models.lora`); without that
    its adapters got none and never trained."""
    layers = 6 if vpp else POLICY["num_hidden_layers"]
    hf = build_tiny_model(tmp_path / "hf", {**POLICY, "num_hidden_layers": layers})
    adapter = tmp_path / "adapter"
    _peft_adapter(hf, adapter, fused=kind == "lora")
    batch = ppo_batch(hf, rows=6 if pp == 3 else 8)  # the prompts split over 3 rollout replicas at PP3
    case = CASES[0]
    peft_model = _peft_model(hf, adapter)
    expected = reference_step(hf, batch, case, model=peft_model)
    grads = {n.replace(".default", ""): g for n, g in expected["grads"].items()}
    assert grads and all(".lora_" in n for n in grads)  # peft: the adapters alone get gradients
    if kind == "lora":
        grads = fused_grads(grads)
    config = actor_config(hf, case, tp=tp, pp=pp, dp=dp, rows=len(batch))
    lora = config.actor_rollout_ref.model.lora
    lora.rank, lora.alpha, lora.type, lora.target_modules = RANK, ALPHA, kind, list(TARGETS[kind])
    lora.adapter_path = str(adapter)
    config.actor_rollout_ref.actor.megatron.context_parallel_size = cp
    config.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size = vpp
    config.actor_rollout_ref.model.enable_gradient_checkpointing = recompute
    config.trainer.n_gpus_per_node = tp * pp * dp * cp
    results = run_ranks(_lora_step_rank, tp * pp * dp * cp, config, batch, timeout_s=300)

    from hybridrl.models.lora import read_peft_adapter
    from hybridrl.training.backend import lora_settings

    saved = read_peft_adapter(adapter, lora_settings(lora, 0))
    assert set().union(*(r["before"] for r in results)) == set(grads)  # each stage holds its layers' adapters
    for result in results:
        assert set(result["grads"]) == set(result["before"])
        for name, tensor in result["before"].items():  # peft's folder, read onto this layout
            assert torch.equal(tensor, saved[name]), name
        for name, got in result["grads"].items():
            ref = grads[name]
            scale = float(ref.abs().max())
            assert scale > 0 and float((got - ref).abs().max()) <= GRAD_RTOL * scale, name
        assert result["base_changed"] == []  # the base is frozen
        assert all(not torch.equal(result["after"][n], result["before"][n]) for n in result["before"])  # trained
        # the optimizer and DDP's gradient buffers hold the adapters alone (this rank's share of them)
        assert result["trainable"] == result["optimized"] == result["adapter_numel"] == result["ddp_buffers"] > 0
    # the plan's count of them (its memory figures): each rank's adapters, layer by layer
    from hybridrl.config.plan import lora_elements_per_layer
    from hybridrl.models.arch import ModelShape, read_hf_config

    per_layer = lora_elements_per_layer(lora, ModelShape.from_hf_config(read_hf_config(hf)), tp)
    assert all(r["adapter_numel"] == per_layer * layers // pp for r in results)
    metrics = next(r["metrics"] for r in results if r["metrics"] is not None)
    for name in ("pg_loss", "kl_loss", "approx_kl", "entropy"):
        value, ref = getattr(metrics, name), expected[name]
        assert abs(value - ref) <= SCALAR_RTOL * max(1.0, abs(ref)), (name, value, ref)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for n, g in grads.items()
                          if kind == "canonical_lora" or ".lora_B." in n or any(
                              f".{layer[0]}.lora_A." in n for layer in LAYER_PROJECTIONS.values())))
    assert abs(metrics.grad_norm - float(norm)) <= GRAD_RTOL * float(norm), (metrics.grad_norm, float(norm))
    # the reference pass (adapters off) scores with the base model: transformers' log-probs without adapters
    with torch.no_grad(), peft_model.disable_adapter():
        from tests.support.actor_reference import response_log_softmax

        _, log_softmax = response_log_softmax(hf, batch, model=peft_model)
    base = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]
    outputs = [r["base_log_probs"] for r in results if r["base_log_probs"] is not None]
    assert outputs
    got = torch.cat(outputs) if dp > 1 else outputs[0]
    assert (got - base).abs().max() <= 1e-5


def test_a_bf16_base_with_fp32_adapters_equals_peft_and_runs_under_strict_device(tmp_path):
    """What LoRA on a GPU runs (megatron's local layer spec there too, `layer_spec_kind`): the base in bf16 and the
    adapters in fp32, at TP2 x DP2. Against peft on the transformers model in bf16 (its adapters fp32, as peft keeps
    them): adapter gradients and loss terms within the two bf16 models' rounding (measured: 6 % of a tensor's
    largest gradient at worst), and no farther from the fp32 model's gradients than peft's bf16 ones are (relative
    L2 over all of them: 0.151 against peft's 0.147; each tensor alone is up to 70 % off, so fp32 is no reference
    tensor by tensor); the base bf16 and untouched, the adapters fp32 and computing in fp32. The same step with
    megatron's distributed optimizer under strict-device mode (every tensor where CUDA needs it) updates the adapters
    as the plain optimizer does."""
    import peft
    import transformers

    hf = build_tiny_model(tmp_path / "hf", POLICY)
    adapter = tmp_path / "adapter"
    _peft_adapter(hf, adapter, fused=True)
    batch = ppo_batch(hf)
    case = CASES[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    assert {p.dtype for n, p in peft_model.named_parameters() if "lora_" in n} == {torch.float32}
    expected = reference_step(hf, batch, case, model=peft_model)
    grads = fused_grads({n.replace(".default", ""): g.float() for n, g in expected["grads"].items()})
    exact = reference_step(hf, batch, case, model=_peft_model(hf, adapter))  # fp32: how far bf16 alone moves them
    fp32 = fused_grads({n.replace(".default", ""): g for n, g in exact["grads"].items()})

    def config(distributed: bool) -> Any:
        c = actor_config(hf, case, tp=2, dp=2, distributed_optimizer=distributed, rows=len(batch))
        c.actor_rollout_ref.actor.megatron.dtype = "bf16"
        lora = c.actor_rollout_ref.model.lora
        lora.rank, lora.alpha, lora.type, lora.target_modules = RANK, ALPHA, "lora", list(TARGETS["lora"])
        lora.adapter_path = str(adapter)
        return c

    plain = run_ranks(_lora_step_rank, 4, config(False), batch, timeout_s=300)
    errors = []
    for result in plain:
        # the base's weights but its norms (megatron's WrappedTorchNorm builds torch's RMSNorm in fp32)
        assert result["dtypes"] == {"base": {"torch.bfloat16"}, "adapters": {"torch.float32"}}
        assert result["base_changed"] == []
        assert result["trainable"] == result["optimized"] == result["adapter_numel"] == result["ddp_buffers"] > 0
        assert set(result["grads"]) == set(grads)
        errors += [float((got - grads[n]).abs().max() / grads[n].abs().max()) for n, got in result["grads"].items()]
        assert result["delta_dtype"] == "torch.float32"  # the adapters compute in fp32 on a bf16 input
    assert max(errors) <= BF16_GRAD_RTOL, max(errors)

    def off_fp32(got: dict[str, torch.Tensor]) -> float:  # relative L2 over every adapter gradient
        names = sorted(fp32)
        return float(torch.cat([(got[n].float() - fp32[n]).flatten() for n in names]).norm()
                     / torch.cat([fp32[n].flatten() for n in names]).norm())

    ours, peft_own = off_fp32(plain[0]["grads"]), off_fp32(grads)
    print(f"relative L2 off the fp32 gradients: ours {ours:.3g}, peft's in bf16 {peft_own:.3g}")
    assert ours <= 1.5 * peft_own  # the bf16 base's rounding, no more than peft's own
    metrics = next(r["metrics"] for r in plain if r["metrics"] is not None)
    for name in ("pg_loss", "kl_loss", "approx_kl", "entropy"):
        value, ref = getattr(metrics, name), expected[name]
        assert abs(value - ref) <= BF16_SCALAR_RTOL * max(1.0, abs(ref)), (name, value, ref)
    # megatron's distributed optimizer (fp32 adapters next to a bf16 base) under strict-device mode; its gradient
    # buffers hold each rank's shard reduced only, so the update itself is compared
    strict = run_ranks(_strict_lora_step_rank, 4, config(True), batch, timeout_s=300)
    for mine, theirs in zip(strict, plain, strict=True):
        assert mine["dtypes"] == theirs["dtypes"] and mine["base_changed"] == []
        for name, after in theirs["after"].items():
            moved = (after - theirs["before"][name]).abs().max()
            assert moved > 0 and (mine["after"][name] - after).abs().max() <= 1e-5 * moved, name


def _checkpoint_rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, save: bool) -> dict[str, Any]:
    """save: one update, a checkpoint, the next update; else: the checkpoint loaded, the next update."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.lora import lora_adapters, lora_state
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint
    from hybridrl.training.optimizer_state import OptimizerView
    from hybridrl.training.train_state import StateEntry

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    adapters = lora_adapters(backend.chunks)
    dp, dp_rank = backend.ctx.dp, backend.ctx.dp_rank
    out: dict[str, Any] = {}
    if save:
        actor.update_policy(batches[0].split(dp)[dp_rank])
        save_role_checkpoint(backend, ckpt)
        out["saved"] = lora_state(adapters)
    else:
        load_role_checkpoint(backend, ckpt)
        out["loaded"] = lora_state(adapters)
        view = OptimizerView(backend.optimizer)  # with a plain optimizer: each parameter's whole state

        def moment(kind: str) -> dict[str, torch.Tensor]:
            def state(p: torch.Tensor) -> torch.Tensor:
                slot = view.slot(StateEntry("", None, p, False))
                return slot.inner.state[slot.main][kind].reshape(p.shape)
            return lora_state(adapters, of=state)
        # (a distributed optimizer's shards are compared by `_optimizer_state_against_the_file`)
        out["moments"] = {} if view.distributed else {kind: moment(kind) for kind in ("exp_avg", "exp_avg_sq")}
    actor.update_policy(batches[1].split(dp)[dp_rank])
    out["next"] = lora_state(adapters)
    return out


def _adapter_job(hf: Path, adapter: Path, tp: int, dp: int, distributed: bool, rows: int,
                 dtype: str | None = None) -> Any:
    """The actor job of the checkpoint tests: the PPO case on a TP x DP layout, adapters from peft's folder."""
    c = actor_config(hf, CASES[0], tp=tp, dp=dp, distributed_optimizer=distributed, rows=rows)
    c.actor_rollout_ref.actor.megatron.dtype = dtype
    lora = c.actor_rollout_ref.model.lora
    lora.rank, lora.alpha, lora.adapter_path = RANK, ALPHA, str(adapter)
    return c


def test_adapters_and_their_optimizer_state_resume_on_another_layout(tmp_path):
    """A LoRA actor saved at DP2 with the distributed optimizer (its Adam shards gathered whole) and resumed at TP2
    with a plain one: the adapters and Adam's moments are the saved ones, whole under peft's names; the next
    update equals the uninterrupted run's (1e-5); the checkpoint's lora/ folder is a PEFT adapter that peft loads
    onto the transformers model, giving the adapted model's logits."""
    import peft
    import transformers
    from safetensors.torch import load_file

    hf = build_tiny_model(tmp_path / "hf", POLICY)
    adapter = tmp_path / "adapter"
    _peft_adapter(hf, adapter, fused=True)
    batches = [ppo_batch(hf, seed=11), ppo_batch(hf, seed=12)]

    def config(tp: int, dp: int, distributed: bool) -> Any:
        return _adapter_job(hf, adapter, tp, dp, distributed, len(batches[0]))

    ckpt = tmp_path / "ckpt"
    saved = run_ranks(_checkpoint_rank, 2, config(1, 2, True), batches, str(ckpt), True, timeout_s=300)
    resumed = run_ranks(_checkpoint_rank, 2, config(2, 1, False), batches, str(ckpt), False, timeout_s=300)
    stage = load_file(str(ckpt / "lora_state_pp000.safetensors"))
    for result in resumed:
        assert result["loaded"].keys() == saved[0]["saved"].keys()
        for name, tensor in saved[0]["saved"].items():
            assert torch.equal(result["loaded"][name], tensor), name
            assert torch.equal(stage[f"weight/{name}"], tensor), name
        for kind, moments in result["moments"].items():
            for name, tensor in moments.items():
                assert torch.equal(tensor, stage[f"{kind}/{name}"]), (kind, name)
            assert any(bool(t.abs().max() > 0) for t in moments.values())  # a real step's state
        for name, tensor in saved[0]["next"].items():
            scale = float(tensor.abs().max())
            assert float((result["next"][name] - tensor).abs().max()) <= 1e-5 * max(scale, 1.0), name
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, ckpt / "lora")
    state = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert sorted(state) == sorted(saved[0]["saved"])
    assert all(torch.equal(state[n].detach(), t) for n, t in saved[0]["saved"].items())
    # `hybridrl convert mcore-to-hf` of the checkpoint merges the adapters: transformers on the merged folder gives
    # peft's logits (the base's own would differ)
    from hybridrl.models.convert_cli import main as convert

    assert convert(["mcore-to-hf", "--ckpt", str(ckpt / "model"), "--out", str(tmp_path / "merged"), "--quiet"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokens = batches[0]["input_ids"][:2]
    with torch.no_grad():
        expected, got = loaded(input_ids=tokens).logits, merged(input_ids=tokens).logits
        with loaded.disable_adapter():
            plain = loaded(input_ids=tokens).logits
    assert (got - expected).abs().max() <= 1e-5 and (plain - expected).abs().max() > 1e-3
    # an actor whose adapters differ from the saved ones (alpha) is refused, naming both settings
    from tests.support.forked import RankError

    other = config(2, 1, False)
    other.actor_rollout_ref.model.lora.alpha = 2 * ALPHA
    other.actor_rollout_ref.model.lora.adapter_path = None
    with pytest.raises(RankError, match="saved with LoRA settings .*'alpha': 8.0.*'alpha': 16.0"):
        run_ranks(_checkpoint_rank, 2, other, batches, str(ckpt), False, timeout_s=300)


def test_a_bf16_bases_adapters_resume_with_their_fp32_optimizer_state(tmp_path):
    """A bf16 base with fp32 adapters (what a GPU trains) saved at DP2 with the distributed optimizer: the file holds
    the adapters and Adam's moments in fp32 (no master copy: the adapters are fp32 parameters, megatron's optimizer
    keeps none for them), a resume on the same layout continues exactly as the uninterrupted run (1e-6), and one at
    TP2 with a plain optimizer holds the saved adapters and moments exactly."""
    from safetensors.torch import load_file

    hf = build_tiny_model(tmp_path / "hf", POLICY)
    adapter = tmp_path / "adapter"
    _peft_adapter(hf, adapter, fused=True)
    batches = [ppo_batch(hf, seed=11), ppo_batch(hf, seed=12)]

    def config(tp: int, dp: int, distributed: bool) -> Any:
        return _adapter_job(hf, adapter, tp, dp, distributed, len(batches[0]), dtype="bf16")

    ckpt = tmp_path / "ckpt"
    saved = run_ranks(_checkpoint_rank, 2, config(1, 2, True), batches, str(ckpt), True, timeout_s=300)
    stage = load_file(str(ckpt / "lora_state_pp000.safetensors"))
    assert {k.split("/")[0] for k in stage} == {"weight", "exp_avg", "exp_avg_sq"}
    assert {t.dtype for t in stage.values()} == {torch.float32}
    same = run_ranks(_checkpoint_rank, 2, config(1, 2, True), batches, str(ckpt), False, timeout_s=300)
    for result in same:
        for name, tensor in saved[0]["next"].items():
            assert _close(result["next"][name], tensor, 1e-6), name
    other = run_ranks(_checkpoint_rank, 2, config(2, 1, False), batches, str(ckpt), False, timeout_s=300)
    for result in other:
        for name, tensor in saved[0]["saved"].items():
            assert torch.equal(result["loaded"][name], tensor) and torch.equal(stage[f"weight/{name}"], tensor), name
        for kind, moments in result["moments"].items():
            assert all(torch.equal(t, stage[f"{kind}/{n}"]) for n, t in moments.items()), kind
            assert any(bool(t.abs().max() > 0) for t in moments.values())


def _optimizer_state_against_the_file(backend: Any, adapters: list[Any], ckpt: str) -> dict[str, Any]:
    """This rank's Adam moments of the adapters against the checkpoint's stage file: each parameter's part the
    rank's optimizer holds (whole, or its distributed optimizer's flat shard over the group megatron sharded it
    over) compared with the file's whole tensor cut the same way. Elements that equal and that differ per kind, and
    how many of the adapters' elements the rank's optimizer holds (and of its parameters, how many only in part)."""
    from safetensors.torch import load_file

    from hybridrl.models.lora import local_lora_tensors
    from hybridrl.training.optimizer_state import OptimizerView
    from hybridrl.training.train_state import StateEntry

    stage = load_file(str(Path(ckpt) / "lora_state_pp000.safetensors"))
    view = OptimizerView(backend.optimizer)
    out: dict[str, Any] = {"held": 0, "split": 0,
                           "adapter_numel": sum(p.numel() for a in adapters for p in a.parameters()),
                           # (dense, expert) DP sizes of a distributed optimizer's parts (megatron's ChainedOptimizer)
                           "sharded_over": [part.data_parallel_group.size() for part in view.distributed]}
    for kind in ("exp_avg", "exp_avg_sq"):
        whole = local_lora_tensors(adapters, {k.split("/", 1)[1]: t for k, t in stage.items()
                                              if k.startswith(f"{kind}/")})
        equal = differ = 0
        for param, expected in whole.items():
            slot = view.slot(StateEntry("", None, param, False))
            if slot is None:  # another rank of its group holds all of it
                continue
            if kind == "exp_avg":
                out["held"] += slot.main.numel()
                out["split"] += int(slot.main.numel() < param.numel())  # a shard boundary inside it
            same = slot.inner.state[slot.main][kind].cpu() == slot.piece(expected)
            equal, differ = equal + int(same.sum()), differ + int((~same).sum())
        out[kind] = (equal, differ)
    return out


def _grad_norm(metrics: Any) -> float | None:
    """An update's grad norm on the rank that reports the metrics (None elsewhere)."""
    return None if metrics is None else metrics.grad_norm


def _moe_checkpoint_rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, save: bool
                         ) -> dict[str, Any]:
    """An expert-parallel LoRA actor. save: one update, a checkpoint, the next update; else: the checkpoint loaded,
    the next update. The adapters (every expert's, gathered) after each; on a resume, the optimizer's moments
    against the file."""
    from hybridrl.models.lora import lora_adapters, lora_state
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint
    from tests.support.training_fixtures import trained_role

    backend, update, chunks = trained_role(config, "actor", batches)
    adapters = lora_adapters(backend.chunks)
    out: dict[str, Any] = {"experts": sorted({a.expert for a in adapters if a.expert is not None}),
                           "expert_tp": sorted({a.tp for a in adapters if a.expert is not None})}
    if save:
        out["grad_norm"] = _grad_norm(update(chunks[0]))
        save_role_checkpoint(backend, ckpt)
        out["saved"] = lora_state(adapters)
    else:
        load_role_checkpoint(backend, ckpt)
        out["loaded"] = lora_state(adapters)
        out["moments"] = _optimizer_state_against_the_file(backend, adapters, ckpt)
    out["next_grad_norm"] = _grad_norm(update(chunks[1]))
    out["next"] = lora_state(adapters)
    return out


# (TP, EP, the distributed optimizer, world). On 2 ranks: at EP2 the dense adapters' Adam state is sharded over the
# 2 DP ranks and each expert's whole on its EP rank (expert DP 1); at TP2 (sequence parallelism, each expert whole)
# and at TP1 x EP1 (DP2) the experts' state is sharded over the expert data-parallel group, the 2 ranks. On 4 ranks,
# EP2 x DP2 (the usual MoE layout): the experts' over expert DP 2, ranks {0, 2} and {1, 3}, the dense over all 4
MOE_LAYOUTS = {"ep2": (1, 2, False, 2), "ep2-distopt": (1, 2, True, 2), "ep1": (1, 1, False, 2),
               "tp2": (2, 1, False, 2), "tp2-distopt": (2, 1, True, 2),
               "ep2-dp2": (1, 2, False, 4), "ep2-dp2-distopt": (1, 2, True, 4)}
# Each expert split over expert TP 2 (`EXPERT_TP`; the layouts above keep each expert whole, ETP 1): at TP2
# (megatron's default ETP = TP), at TP2 x DP2 with the experts' Adam state sharded over expert DP 2 (ranks {0, 2}
# and {1, 3}), at TP2 x DP2 as ETP2 x EP2, and at TP1 x DP2 (expert TP over the dense DP ranks)
MOE_LAYOUTS["etp2"] = (2, 1, False, 2)
MOE_LAYOUTS["etp2-dp2"] = (2, 1, False, 4)
MOE_LAYOUTS["etp2-dp2-distopt"] = (2, 1, True, 4)
MOE_LAYOUTS["ep2-etp2"] = (2, 2, False, 4)
MOE_LAYOUTS["tp1-etp2"] = (1, 1, False, 2)
EXPERT_TP = {"etp2": 2, "etp2-dp2": 2, "etp2-dp2-distopt": 2, "ep2-etp2": 2, "tp1-etp2": 2}


# the distributed optimizer's (dense, expert) groups on those layouts: DP x CP, and expert DP
SHARDED_OVER = {"ep2-distopt": [2, 1], "tp2-distopt": [1, 2], "ep2-dp2-distopt": [4, 2]}
SHARDED_OVER["etp2-dp2-distopt"] = [2, 2]


def _moe_lora_config(hf: Path, layout: str) -> Any:
    from tests.support.training_fixtures import job_config

    tp, ep, distributed, world = MOE_LAYOUTS[layout]
    c = job_config(hf, world=world, tp=tp, distributed_optimizer=distributed)
    megatron = c.actor_rollout_ref.actor.megatron
    megatron.expert_model_parallel_size = ep
    if tp > 1:  # megatron's MoE layer trains at TP > 1 only with sequence parallelism
        megatron.sequence_parallel, megatron.expert_tensor_parallel_size = True, 1
    if layout in EXPERT_TP:
        megatron.expert_tensor_parallel_size = EXPERT_TP[layout]
    c.actor_rollout_ref.model.lora.rank, c.actor_rollout_ref.model.lora.alpha = RANK, ALPHA
    return c


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    return float((got - want).abs().max()) <= rtol * max(float(want.abs().max()), 1.0)


@pytest.mark.parametrize("saved_on,resumed_on", [("ep2", "ep1"), ("ep2-distopt", "ep1"), ("ep1", "ep2-distopt"),
                                                 ("tp2-distopt", "ep2"), ("ep2", "tp2-distopt"),
                                                 ("ep2-dp2-distopt", "ep1"), ("ep2", "ep2-dp2-distopt"),
                                                 ("etp2", "ep2"),
                                                 ("ep2", "etp2"),
                                                 ("etp2-dp2-distopt", "ep1"),
                                                 ("ep2", "etp2-dp2-distopt"),
                                                 ("ep2-etp2", "tp1-etp2")])
def test_expert_adapters_and_their_optimizer_state_resume_on_another_ep_layout(tmp_path, saved_on, resumed_on):
    """A LoRA actor on a Qwen3-MoE (8 experts, adapters on each) saved on one layout and resumed on another, with
    megatron's distributed optimizer on either side (its Adam shards of the dense adapters over DP, of the experts'
    over the expert data-parallel group): the adapters are the saved ones, the resumed optimizer holds the file's
    moments exactly (its own shard of them), and the next update equals the uninterrupted run's (1e-5 of the
    largest entry). A run saved with the distributed optimizer trains and saves what the same layout's plain
    optimizer does (adapters and Adam moments within 1e-5)."""
    from safetensors.torch import load_file

    from tests.support.models_fixtures import make_hf_model
    from tests.support.training_fixtures import rollout_batch

    # 3 layers: at EP2 x DP2 a shard boundary of the dense adapters falls inside a parameter (with 4, every boundary
    # fell between two, and a restore handing each rank the wrong part of a split parameter went unseen)
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, mlp_only_layers=[], num_hidden_layers=3)
    batches = [rollout_batch(8, seed=1), rollout_batch(8, seed=2)]
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(_moe_checkpoint_rank, MOE_LAYOUTS[saved_on][3], _moe_lora_config(hf, saved_on), batches,
                      str(ckpt), True, timeout_s=400)
    ep, etp = MOE_LAYOUTS[saved_on][1], EXPERT_TP.get(saved_on, 1)
    # each rank holds its EP rank's experts (global rank r is EP rank r // ETP % EP: the expert mesh's etp-ep-edp order)
    assert [r["experts"] for r in saved] == [list(range(r // etp % ep * 8 // ep, (r // etp % ep + 1) * 8 // ep))
                                            for r in range(len(saved))]
    resumed = run_ranks(_moe_checkpoint_rank, MOE_LAYOUTS[resumed_on][3], _moe_lora_config(hf, resumed_on), batches,
                        str(ckpt), False, timeout_s=400)
    for layout, runs in ((saved_on, saved), (resumed_on, resumed)):  # each expert's adapters split as its weights
        assert all(r["expert_tp"] == [EXPERT_TP.get(layout, 1)] for r in runs), layout
    reference = saved[0]
    stage = load_file(str(ckpt / "lora_state_pp000.safetensors"))
    assert any(".experts.7.down_proj.lora_B" in n and t.abs().max() > 0 for n, t in reference["saved"].items())
    if MOE_LAYOUTS[saved_on][2]:  # the same layout with a plain optimizer: what the distributed one must hold
        plain = tmp_path / "plain"
        same_plain = run_ranks(_moe_checkpoint_rank, MOE_LAYOUTS[saved_on][3],
                               _moe_lora_config(hf, saved_on.removesuffix("-distopt")), batches, str(plain), True,
                               timeout_s=400)
        for key in ("grad_norm", "next_grad_norm"):  # every adapter's shard counted once, over every rank
            got, want = (next(r[key] for r in runs if r[key] is not None) for runs in (saved, same_plain))
            assert got == pytest.approx(want, rel=1e-5), key
        expected = load_file(str(plain / "lora_state_pp000.safetensors"))
        assert stage.keys() == expected.keys()
        assert {k.split("/")[0] for k in stage} == {"weight", "exp_avg", "exp_avg_sq"}
        for name, tensor in expected.items():
            assert _close(stage[name], tensor, 1e-5), name
    resumed_norm, uninterrupted_norm = (next(r["next_grad_norm"] for r in runs if r["next_grad_norm"] is not None)
                                        for runs in (resumed, saved))
    assert resumed_norm == pytest.approx(uninterrupted_norm, rel=1e-5)
    if resumed_on == "ep2-dp2-distopt":
        assert sum(r["moments"]["split"] for r in resumed) > 0
    for result in resumed:
        assert result["loaded"].keys() == reference["saved"].keys()
        for name, tensor in reference["saved"].items():
            assert torch.equal(result["loaded"][name], tensor), name
            assert torch.equal(stage[f"weight/{name}"], tensor), name
        for kind in ("exp_avg", "exp_avg_sq"):
            equal, differ = result["moments"][kind]
            assert equal > 0 and differ == 0, (kind, equal, differ)
        # the distributed optimizer holds a shard of the adapters' state on each rank, a plain one all of it
        held, numel = result["moments"]["held"], result["moments"]["adapter_numel"]
        assert held < numel if MOE_LAYOUTS[resumed_on][2] else held == numel, (held, numel)
        assert result["moments"]["sharded_over"] == SHARDED_OVER.get(resumed_on, [])
        for name, tensor in reference["next"].items():
            assert _close(result["next"][name], tensor, 1e-5), name


def _failed_save_rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str,
                      failing_ranks: tuple[int, ...]) -> str | None:
    """One update, then a checkpoint whose gather of the distributed optimizer's shards reports a gap on
    `failing_ranks` alone (after its collectives, as a real coverage error does): the error each rank raised."""
    import hybridrl.training.lora_checkpoint as lora_checkpoint
    from hybridrl.persistence import RoleCheckpointError
    from hybridrl.training.checkpointing import save_role_checkpoint
    from tests.support.training_fixtures import trained_role

    real = lora_checkpoint.gather_sharded

    def gap_here(*args: Any, **kwargs: Any) -> Any:
        gathered = real(*args, **kwargs)
        if rank in failing_ranks:
            raise RuntimeError("planted: DP shards cover 0 of 1 elements")
        return gathered

    lora_checkpoint.gather_sharded = gap_here
    backend, update, chunks = trained_role(config, "actor", batches)
    update(chunks[0])
    try:
        save_role_checkpoint(backend, ckpt)
    except RoleCheckpointError as exc:
        return str(exc)
    return None


def test_a_gap_in_one_expert_groups_optimizer_shards_stops_every_rank(tmp_path):
    """At EP2 x DP2 with the distributed optimizer the experts' Adam shards are gathered over two expert
    data-parallel groups, ranks {0, 2} and {1, 3}. A gap found in one group's gather raises on every rank of the
    world, naming the ranks that found it: the other group's ranks must not wait in the next collective (a hang)."""
    from tests.support.models_fixtures import make_hf_model
    from tests.support.training_fixtures import rollout_batch

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, mlp_only_layers=[], num_hidden_layers=3)
    errors = run_ranks(_failed_save_rank, 4, _moe_lora_config(hf, "ep2-dp2-distopt"), [rollout_batch(8, seed=1)],
                       str(tmp_path / "ckpt"), (0, 2), timeout_s=300)
    for error in errors:  # every rank's: the two ranks that found the gap named, the others found none
        assert error is not None
        assert "rank 0: RuntimeError: planted" in error and "rank 2: RuntimeError: planted" in error, error
        assert "rank 1: RuntimeError" not in error and "rank 3: RuntimeError" not in error, error


MOMENTS = ("exp_avg", "exp_avg_sq")


def _whole_moments_by_hand(adapters: list[Any], view: Any) -> dict[str, dict[int, torch.Tensor]]:
    """Each of this rank's adapter parameters' Adam moments whole (by id), assembled with plain torch.distributed:
    every rank's part (its flat shard range with the distributed optimizer, else all) all-gathered over the world,
    matched to a parameter by its adapter's peft name, half and TP rank."""
    import torch.distributed as dist

    from hybridrl.training.train_state import StateEntry

    params: dict[tuple[str, int], torch.Tensor] = {}
    for adapter in adapters:
        for part, a, b in zip(adapter.parts, adapter.lora_A, adapter.lora_B, strict=True):
            for half, param in (("lora_A", a), ("lora_B", b)):
                params[(adapter.peft_name(part[0], half), adapter.tp_rank)] = param
    mine = []
    for key, param in params.items():
        slot = view.slot(StateEntry("", None, param, False))
        if slot is not None:
            start, stop = (0, param.numel()) if slot.start is None else slot.flat_range
            mine.append((key, start, stop, {kind: slot.inner.state[slot.main][kind].detach().reshape(-1).clone()
                                            for kind in MOMENTS}))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    whole = {kind: {id(p): torch.full((p.numel(),), float("nan")) for p in params.values()} for kind in MOMENTS}
    for theirs in everyone:
        for key, start, stop, by_kind in theirs:
            if key in params:
                for kind, shard in by_kind.items():
                    whole[kind][id(params[key])][start:stop] = shard
    assert not any(t.isnan().any() for by_param in whole.values() for t in by_param.values())
    return {kind: {id(p): by_param[id(p)].reshape(p.shape) for p in params.values()}
            for kind, by_param in whole.items()}


def _stage_save_rank(rank: int, world: int, config: Any, batches: list[Any], staging: str) -> dict[str, Any]:
    """One update, then the stage's adapter file (`save_lora_checkpoint`): the adapter-state bytes this rank held
    whole for it, and (rank 0) the file's tensors as the every-rank gather computes them: the adapters whole on
    every rank (`lora_state` without a root, over the world's TP and EP groups), their Adam moments assembled from
    every rank's optimizer shards here with plain torch.distributed."""
    from hybridrl.models.lora import lora_adapters, lora_state
    from hybridrl.training.lora_checkpoint import save_lora_checkpoint
    from hybridrl.training.optimizer_state import OptimizerView
    from tests.support.training_fixtures import trained_role

    backend, update, chunks = trained_role(config, "actor", batches)
    update(chunks[0])
    saved = save_lora_checkpoint(backend, Path(staging))
    adapters = lora_adapters(backend.chunks)
    moments = _whole_moments_by_hand(adapters, OptimizerView(backend.optimizer))
    expected = {f"weight/{name}": t for name, t in lora_state(adapters).items()}
    for kind, by_param in moments.items():
        state = lora_state(adapters, of=lambda p, by_param=by_param: by_param[id(p)])
        expected.update({f"{kind}/{name}": t for name, t in state.items()})
    return {"held_bytes": saved.held_bytes, "files": saved.files, "expected": expected if rank == 0 else None}


def _held_bytes_by_hand(hf: Path, layout: str) -> list[int]:
    """What each rank of `layout` holds whole while saving the test model's adapters (fp32, rank RANK, type lora),
    counted from the shapes: the writer (rank 0) the stage file's tensors and the Adam moments of its own adapters
    gathered from distributed-optimizer shards; a rank that feeds it the moments of the parameters it sends (its
    experts over EP; its halves split over TP or expert TP), gathered whole from their shards; every other rank
    nothing."""
    from hybridrl.models.arch import ModelShape, read_hf_config

    shape = ModelShape.from_hf_config(read_hf_config(hf))
    assert len(shape.moe_layers) == shape.num_layers  # experts in every layer
    r, h, layers = RANK, shape.hidden_size, shape.num_layers
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    ffn, experts = shape.moe_ffn_hidden_size, shape.num_experts
    # per layer, the parameters: linear_qkv's one A [r, h] and B [q + 2 kv, r], linear_proj's A [r, q] and B [h, r];
    # each expert's linear_fc1 A [r, h] and B [2 ffn, r] (gate and up), linear_fc2's A [r, ffn] and B [h, r]
    qkv_a, qkv_b, o_a, o_b = r * h, (q + 2 * kv) * r, r * q, h * r
    expert = r * h + 2 * ffn * r + r * ffn + h * r
    # the file's tensors under peft's names per layer: a fused A once for each projection it serves (q, k, v; gate, up)
    named = 3 * qkv_a + qkv_b + o_a + o_b + experts * (2 * r * h + 2 * ffn * r + r * ffn + h * r)
    fp32 = 4
    whole_file = (1 + len(MOMENTS)) * named * layers * fp32
    moments = len(MOMENTS) * layers * fp32  # bytes of the gathered moments per element of a layer's parameters
    if layout == "ep2":  # a plain optimizer: nothing to gather
        return [whole_file, 0]
    if layout == "ep2-dp2-distopt":  # the writer's EP group is ranks {0, 1}; the dense adapters' shards go to rank 0
        return [whole_file + moments * (qkv_a + qkv_b + o_a + o_b + experts // 2 * expert),
                moments * experts // 2 * expert, 0, 0]
    if layout == "tp2-distopt":  # TP rank 1 sends its halves of qkv's B and o_proj's A; each expert whole on rank 0
        return [whole_file + moments * (qkv_a + qkv_b // 2 + o_a // 2 + o_b + experts * expert),
                moments * (qkv_b // 2 + o_a // 2)]
    if layout == "etp2-dp2-distopt":
        # TP (and expert TP) rank 1 sends its halves split over TP: qkv's B and o_proj's A, and each expert's fc1 B
        # and fc2 A; not the halves each expert TP rank holds whole (fc1's A, fc2's B: rank 0 gives those). Ranks 2
        # and 3, the other DP replica, only send their optimizer shards
        split_expert = 2 * ffn * r // 2 + r * ffn // 2
        return [whole_file + moments * (qkv_a + qkv_b // 2 + o_a // 2 + o_b + experts * (r * h + split_expert + h * r)),
                moments * (qkv_b // 2 + o_a // 2 + experts * split_expert), 0, 0]
    raise ValueError(layout)


@pytest.mark.parametrize("layout", ["ep2", "ep2-dp2-distopt", "tp2-distopt",
                                    "etp2-dp2-distopt"])
def test_only_the_writer_holds_a_stages_whole_adapter_state(tmp_path, layout):
    """A LoRA checkpoint's stage file (every expert's adapters and Adam moments) is assembled on its writer alone:
    the ranks of the writer's EP group (or TP group) hold only the state they send it, the other ranks nothing
    (before, every rank held the whole: for Qwen3-30B-A3B at r 16, ~9 GB each). The file holds exactly the tensors
    the every-rank gather gives."""
    from safetensors.torch import load_file

    from tests.support.models_fixtures import make_hf_model
    from tests.support.training_fixtures import rollout_batch

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, mlp_only_layers=[], num_hidden_layers=3)
    staging = tmp_path / "staging"
    staging.mkdir()
    results = run_ranks(_stage_save_rank, MOE_LAYOUTS[layout][3], _moe_lora_config(hf, layout),
                        [rollout_batch(8, seed=1)], str(staging), timeout_s=300)
    held = [r["held_bytes"] for r in results]
    expected_held = _held_bytes_by_hand(hf, layout)
    assert held == expected_held, f"adapter-state bytes held per rank: {held}, expected {expected_held}"
    assert all(r["files"] == results[0]["files"] for r in results)
    assert list(results[0]["files"]) == ["lora_state_pp000.safetensors"]
    written, expected = load_file(str(staging / "lora_state_pp000.safetensors")), results[0]["expected"]
    assert sorted(written) == sorted(expected)
    assert {name.split("/")[0] for name in written} == {"weight", *MOMENTS}
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
