"""The actor with a tied embedding, against transformers: at PP2 (the first stage holds the embedding,
the last megatron's copy as the output layer) and on one stage (one weight for both, the head's weight
gradient accumulated into its main_grad by the CPU stand-in of megatron's gradient-accumulation fusion
and the lookup's added by DDP's hook: megatron's `zero_out_wgrad`): the response-token-only vocab head
and the fused log-prob/entropy pass, then one update's gradients.

One forked PP2 run computes log-probs and entropies of a rollout-shaped batch, records the rows each
micro-batch sends through the output layer, then runs one on-policy GRPO-style update (no
old-log-prob pass, token-mean) and exports every parameter's reduced gradient. The reference is
transformers' forward on each row's real tokens, and the gradient of the same objective written out
here in plain torch. (The same update on the real SmolLM2 checkpoint at PP2, TP3 and TP1 is
tests/training/test_real_layouts.py.)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.actor_reference import gradients_into_params
from tests.support.forked import run_ranks
from tests.support.models_fixtures import VOCAB, make_hf_model, safetensors_state
from tests.support.training_fixtures import RESPONSE, job_config, rollout_batch

GRAD_RTOL = 1e-5  # of each tensor's largest gradient entry, fp32


def response_log_softmax(model: Any, batch: Any) -> torch.Tensor:
    """transformers' log-softmax `[B, R, V]` at the columns predicting each response token, every row
    run alone on its real tokens (0 past a row's response)."""
    mask = batch["attention_mask"].bool()
    rows = []
    for i in range(mask.shape[0]):
        ids, positions = batch["input_ids"][i][mask[i]], batch["position_ids"][i][mask[i]]
        prompt = int(mask[i, :batch["input_ids"].shape[1] - RESPONSE].sum())
        logits = model(input_ids=ids[None], position_ids=positions[None]).logits[0]
        picked = logits[prompt - 1:].log_softmax(-1)[:RESPONSE]  # predicts response tokens 0..
        rows.append(torch.cat([picked, picked.new_zeros(RESPONSE - picked.shape[0], picked.shape[1])]))
    return torch.stack(rows)


def _tied_rank(rank: int, world: int, config: Any, batch: Any, out_dir: str) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    torch.set_num_threads(1)
    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    head_rows: list[int] = []
    for chunk in backend.chunks:
        if chunk.post_process:
            chunk.output_layer.register_forward_hook(lambda _m, args, _o: head_rows.append(args[0].shape[0]))
    log_probs = actor.compute_log_prob(batch, with_entropy=True)
    metrics = actor.update_policy(batch)
    gradients_into_params(backend)
    export_hf(backend.chunks, out_dir, force=True)
    return {"log_probs": None if log_probs is None else dict(log_probs.tensors), "metrics": metrics,
            "head_rows": head_rows, "last_stage": backend.ctx.is_last_pp_stage,
            "wgrad_fusion": [c.config.gradient_accumulation_fusion for c in backend.chunks]}


@pytest.mark.parametrize("pp", [2, 1])
def test_tied_log_probs_head_rows_and_update_gradients(tmp_path, pp):
    import transformers

    model_dir = make_hf_model(tmp_path / "model", "qwen2", seed=5)  # tied embeddings
    batch = rollout_batch(4, seed=3, vocab=VOCAB)
    del batch.tensors["old_log_probs"]  # on-policy: the update's own forward is the old policy
    config = job_config(model_dir, world=pp, pp=pp, rows=4, micro=2, entropy_coeff=0.0)
    config.actor_rollout_ref.actor.optim.clip_grad = 0.0  # the buffers must hold the unclipped gradient
    results = run_ranks(_tied_rank, pp, config, batch, str(tmp_path / "grads"), timeout_s=300)
    last = [r for r in results if r["last_stage"]]
    assert len(last) == 1
    out = last[0]
    # the trained actor's weight gradients accumulate through the CPU stand-in (the device policy's)
    assert all(flag for r in results for flag in r["wgrad_fusion"])

    # the head saw only the real response tokens: each micro-batch's count, once in the log-prob pass
    # and once in the update
    mask = batch["response_mask"]
    per_micro = [int(mask[i:i + 2].sum()) for i in (0, 2)]
    assert out["head_rows"] == per_micro * 2, (out["head_rows"], per_micro)
    assert sum(per_micro) < 4 * (batch["input_ids"].shape[1])  # far from every column

    # transformers on each row's real tokens alone (megatron left-aligns rows and trims the padding),
    # in fp32 and in fp64: megatron's fp32 results are held to fp64 within fp32's own error on this
    # input (at least 1e-5)
    references = {}
    for dtype in (torch.float32, torch.float64):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                                  attn_implementation="eager")
        log_softmax = response_log_softmax(model, batch)
        log_prob = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * mask
        entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
        # the update's objective: token-mean of -A * ratio, ratio = exp(lp - lp.detach()) = 1
        m = mask.to(dtype)
        loss = -(batch["advantages"].to(dtype) * torch.exp(log_prob - log_prob.detach()) * m).sum() / m.sum()
        loss.backward()
        references[dtype] = {"log_prob": log_prob.detach(), "entropy": entropy.detach(), "loss": float(loss.detach()),
                             "grads": {name: q.grad for name, q in model.named_parameters()}}
        del model
    exact, fp32 = references[torch.float64], references[torch.float32]

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max())

    for key, ours in (("log_prob", out["log_probs"]["old_log_probs"]), ("entropy", out["log_probs"]["entropys"])):
        error, noise = gap(ours, exact[key]), gap(fp32[key], exact[key])
        print(f"\ntied pp{pp} {key}: megatron fp32 vs fp64 {error:.3g}, transformers fp32 vs fp64 {noise:.3g}")
        assert error <= max(1e-5, 1.5 * noise), (key, error, noise)
    assert abs(out["metrics"].pg_loss - exact["loss"]) <= 1e-5 * max(1.0, abs(exact["loss"]))
    grads = safetensors_state(Path(tmp_path / "grads"))
    assert sorted(grads) == sorted(exact["grads"])
    # megatron's gradients sum in other orders (its own backward, DDP's fp32 buffers, the shared
    # embedding's gradient added over the two stages): within twice transformers' fp32 error
    ratios = {}
    for name, ref in exact["grads"].items():
        scale = float(ref.abs().max())
        assert scale > 0, name
        error, noise = gap(grads[name], ref), gap(fp32["grads"][name], ref)
        ratios[name] = error / max(GRAD_RTOL * scale, noise)
    worst = max(ratios, key=ratios.get)
    print(f"tied pp{pp} gradients: worst error / max(1e-5 of scale, transformers fp32 error) "
          f"{ratios[worst]:.3g} ({worst})")
    assert ratios[worst] <= 2.0, (worst, ratios[worst])
