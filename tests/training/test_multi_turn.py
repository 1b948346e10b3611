"""Issue 23's "done when" on a scripted multi-turn trajectory: the megatron actor's log-probs of the
model's tokens equal one transformers forward over the whole conversation (<= 1e-5), observation
tokens get log-prob 0, and no observation token is trained (its advantage, old and reference log-probs
change nothing: the gradient is bit-identical and equals a plain-torch reference that sums over the
model's tokens only).

The conversations come from the real agent loop (char tokenizer and its chat template, the
calculator tool, the Hermes parser), with the model's turns scripted; one megatron rank (forked).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridrl.data.tokenizer import char_tokenizer
from hybridrl.rollout.engine import ResponseRow, assemble_response_rows
from tests.support.actor_reference import gradients_into_params
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, safetensors_state
from tests.support.scripted_model import Script, agent_loop, call
from tests.support.training_fixtures import job_config

BUDGET = 224
ENTROPY_COEFF, KL_COEF = 0.05, 0.3


def conversation_batch() -> Any:
    tok = char_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in ("3+4?", "What is 2*5 then 1/0?")]
    turns = [[call("3+4"), "It is 7."], ["7"], [call("1/0"), "10"], ["x" * 300]]
    trajectories, _ = agent_loop(tok).run([prompts[0], prompts[0], prompts[1], prompts[1]], BUDGET,
                                     Script(tok, turns, tok.eos_token_id))
    assert [t.turns for t in trajectories] == [2, 1, 2, 1]
    assert [t.finish_reason for t in trajectories] == ["stop", "stop", "stop", "length"]
    rows = [ResponseRow(t.tokens, t.mask, t.log_probs, t.finish_reason) for t in trajectories]
    batch = assemble_response_rows(prompts, rows, n=2, width_r=BUDGET, pad_token_id=0, uids=["a", "b"])
    batch.meta["temperature"] = 1.0
    return batch


def _rank(rank: int, world: int, config: Any, batches: list[Any], out_dirs: list[str]) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    result: dict[str, Any] = {"metrics": []}
    for i, (batch, out_dir) in enumerate(zip(batches, out_dirs)):
        backend = MegatronBackend(role_spec(plan, "actor"))  # fresh weights for each update
        actor = MegatronActor(backend, plan)
        if i == 0:
            result["log_probs"] = actor.compute_log_prob(batch, with_entropy=True)
        result["metrics"].append(actor.update_policy(batch))
        gradients_into_params(backend)
        export_hf(backend.chunks, out_dir, force=True)
    return result


def hf_forward(model: Any, batch: Any, prompt_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, ONE forward over prompt + whole conversation (no padding): log-probs and entropies of
    every response token `[B, R]` (0 past the row's end)."""
    t = batch.tensors
    rows, width = t["responses"].shape
    log_probs, entropies = torch.zeros(rows, width), torch.zeros(rows, width)
    for row in range(rows):
        prompt = t["prompts"][row][t["attention_mask"][row, :prompt_width].bool()]
        length = int(t["response_lengths"][row])
        ids = torch.cat([prompt, t["responses"][row, :length]]).unsqueeze(0)
        log_softmax = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + length - 1].log_softmax(-1)
        log_probs[row, :length] = log_softmax.gather(-1, ids[0, len(prompt):].unsqueeze(-1)).squeeze(-1)
        entropies[row, :length] = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropies


def hf_reference(hf: Path, batch: Any, prompt_width: int) -> dict[str, Any]:
    """The PPO objective's gradient, written over the model's tokens only (token-mean; the ratio is 1
    at old = these very log-probs, inside both clip bounds): pg + entropy bonus + k3 KL loss."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    log_probs, entropies = hf_forward(model, batch, prompt_width)
    valid = batch["response_mask"].bool()
    lp, ent = log_probs[valid], entropies[valid]
    adv, ref = batch["advantages"][valid], batch["ref_log_probs"][valid]
    ratio = torch.exp(lp - lp.detach())
    log_ratio = lp - ref
    kl = torch.exp(-log_ratio) + log_ratio - 1
    loss = (-adv * ratio).mean() - ENTROPY_COEFF * ent.mean() + KL_COEF * kl.mean()
    loss.backward()
    return {"log_probs": log_probs.detach(), "entropies": entropies.detach(),
            "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()}}


def test_multi_turn_log_probs_are_one_forward_and_observations_are_never_trained(tmp_path):
    hf = make_hf_model(tmp_path / "hf", "llama", max_position_embeddings=512)  # vocab 200 > the 96 chars
    batch = conversation_batch()
    t = batch.tensors
    prompt_width = t["prompts"].shape[1]
    mask = t["response_mask"].bool()
    attended = t["attention_mask"][:, prompt_width:].bool()
    observation = attended & ~mask
    assert int(observation.sum()) > 40 and bool(observation[0].any()) and bool(observation[2].any())
    # the observation tokens sit between model tokens: interior zeros of the mask
    assert bool(mask[0, -1]) is False and bool(mask[0, int(t["response_lengths"][0]) - 1])

    import transformers

    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                                  attn_implementation="eager")
        policy, _ = hf_forward(model, batch, prompt_width)
    gen = torch.Generator().manual_seed(3)
    shape = mask.shape
    batch["old_log_probs"] = policy * mask
    batch["ref_log_probs"] = (policy + 0.6 * torch.rand(shape, generator=gen) - 0.3) * mask
    batch["advantages"] = torch.randn(shape, generator=gen) * mask
    reference = hf_reference(hf, batch, prompt_width)
    # The same batch with junk wherever response_mask is 0: the observations (and padding).
    junk = batch.index(list(range(len(batch))))
    for key, scale in (("advantages", 50.0), ("old_log_probs", 9.0), ("ref_log_probs", 9.0),
                       ("rollout_log_probs", 9.0)):
        noise = scale * torch.randn(shape, generator=gen)
        junk[key] = torch.where(mask, batch[key], noise)

    config = job_config(hf, world=1, rows=len(batch), micro=2, use_kl_loss=True, kl_loss_coef=KL_COEF,
                        kl_loss_type="low_var_kl", entropy_coeff=ENTROPY_COEFF)
    config.data.max_prompt_length, config.data.max_response_length = prompt_width, BUDGET
    config.actor_rollout_ref.actor.optim.clip_grad = 0.0  # the buffers must hold the unclipped gradient
    config.actor_rollout_ref.rollout.temperature = 1.0
    out_dirs = [str(tmp_path / "grads_clean"), str(tmp_path / "grads_junk")]
    [result] = run_ranks(_rank, 1, config, [batch, junk], out_dirs)

    # log-probs: the megatron actor == one transformers forward over the conversation, model tokens only
    megatron = result["log_probs"]
    gap = (megatron["old_log_probs"] - reference["log_probs"]).abs()[mask]
    assert float(gap.max()) <= 1e-5, float(gap.max())
    assert float((megatron["entropys"] - reference["entropies"]).abs()[mask].max()) <= 1e-5
    assert bool((megatron["old_log_probs"][~mask] == 0).all()) and bool((megatron["entropys"][~mask] == 0).all())
    # vLLM would report its log-probs on the model tokens only; the batch holds 0 on observations
    assert bool((t["rollout_log_probs"][observation] == 0).all())

    clean, noisy = (safetensors_state(Path(d)) for d in out_dirs)
    for name, ref in reference["grads"].items():
        # junk on observation tokens changes nothing, bit for bit
        assert torch.equal(clean[name], noisy[name]), name
        scale = float(ref.abs().max())
        assert scale > 0, name
        assert float((clean[name] - ref).abs().max()) <= 1e-5 * scale, name
    metrics_clean, metrics_junk = result["metrics"]
    for name in ("pg_loss", "kl_loss", "entropy", "grad_norm", "approx_kl"):
        assert getattr(metrics_clean, name) == getattr(metrics_junk, name), name
    assert abs(metrics_clean.entropy - float(reference["entropies"][mask].mean())) <= 1e-5
    # the update's own forward is the old policy (= transformers) on the model's tokens: ratio 1
    assert abs(metrics_clean.approx_kl) <= 1e-6 and metrics_clean.clipfrac == 0.0
