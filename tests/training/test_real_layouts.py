"""One PPO step of the real pretrained model (SmolLM2-135M-Instruct) on megatron, against transformers.

The tiny-model reference (`tests/training/test_actor_reference.py`) spelled out the objective in plain
torch over transformers' forward; here the same reference runs on the real model's 30 layers, vocab
49152 and tied embedding, and megatron's fp32 step must match it at TP1, TP3 (its 9/3 heads allow
TP 1 or 3) and PP2 (the tied embedding split across the stages): loss terms, metrics, grad norm and
every HF tensor's gradient before the optimizer step.

On this model fp32 itself is the limit: with random tokens the log-probs are ~-21 and transformers'
own fp32 step (eager or sdpa attention) is off its float64 value by 2e-5 (approx KL) and up to 4e-4
of a gradient's scale (measured). So the reference is transformers in float64, and each figure of
megatron's fp32 step must be within 3x transformers' own fp32 error of it (or 1e-5 of its scale,
when that is larger); measured at TP1: the loss terms 5-25x closer than transformers' fp32, the
worst gradient 1.8x. The grad norm also carries megatron's fp32 sum of 135M squares (3e-5 of the
norm measured from that alone): 1e-4 of the norm. A wrong layout or objective is off by orders of
magnitude more.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.actor_reference import Case, megatron_steps, ppo_batch, reference_step

# One xdist worker for the module: its transformers references (three real-model steps) are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_layouts")]

REAL_VOCAB = 49152
CASE = Case("token-mean", "low_var_kl")
SCALARS = ("pg_loss", "kl_loss", "approx_kl", "entropy", "grad_norm")
FLOOR = 1e-5  # of a value's scale: the tiny-model tests' tolerance
NOISE_FACTOR = 3
GRAD_NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def real_references(real_model):
    batch = ppo_batch(real_model, rows=12, vocab=REAL_VOCAB)  # 6 prompts: over 2 (PP2) or 3 (TP3) replicas
    exact = reference_step(real_model, batch, CASE, torch.float64, attention="sdpa")
    fp32 = [reference_step(real_model, batch, CASE, torch.float32, attention=a) for a in ("eager", "sdpa")]
    assert 0 < exact["clipfrac"] < 0.9 and exact["grad_norm"] > 1e-2  # the step does something
    noise = {name: max(abs(f[name] - exact[name]) for f in fp32) for name in SCALARS}
    noise["grads"] = {name: max(float((f["grads"][name].double() - ref).abs().max()) for f in fp32)
                      for name, ref in exact["grads"].items()}
    return batch, exact, noise


def _tolerance(noise: float, scale: float) -> float:
    return max(FLOOR * scale, NOISE_FACTOR * noise)


@pytest.mark.parametrize("tp, pp", [(1, 1), (3, 1), (1, 2)], ids=["tp1", "tp3", "pp2"])
def test_real_model_ppo_step_equals_transformers(real_model, real_references, tmp_path, tp, pp):
    batch, exact, noise = real_references
    ((metrics, grads),) = megatron_steps(tmp_path, real_model, batch, tp=tp, pp=pp, dp=1,
                                         distributed_optimizer=False, cases=(CASE,))
    for name in SCALARS:
        value, ref = getattr(metrics, name), exact[name]
        tolerance = _tolerance(noise[name], max(1.0, abs(ref)))
        if name == "grad_norm":
            tolerance = max(tolerance, GRAD_NORM_RTOL * ref)
        assert abs(value - ref) <= tolerance, (name, value, ref, noise[name])
    one_token = 1 / int(batch["response_mask"].sum())  # a clip decision may flip on one token at the bound
    for name in ("clipfrac", "clipfrac_lower"):
        assert abs(getattr(metrics, name) - exact[name]) <= one_token, name
    assert sorted(grads) == sorted(exact["grads"])
    for name, ref in exact["grads"].items():
        scale = float(ref.abs().max())
        err = float((grads[name].double() - ref).abs().max())
        assert scale > 0 and err <= _tolerance(noise["grads"][name], scale), (name, err, noise["grads"][name], scale)
