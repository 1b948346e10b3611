"""One PPO step of the real pretrained model (SmolLM2-135M-Instruct) on megatron, against transformers.

The tiny-model reference (`tests/test_training_actor_reference.py`) spelled out the objective in plain
torch over transformers' forward; here the same reference runs on the real model's 30 layers, vocab
49152 and tied embedding, and megatron's step must equal it at TP1, TP3 (its 9/3 heads allow TP 1
or 3) and PP2 (the tied embedding split across the stages): loss terms, metrics, grad norm and every
HF tensor's gradient before the optimizer step. Equal to one reference, the layouts equal each other.
"""
from __future__ import annotations

import pytest

from tests.test_training_actor_reference import (
    Case,
    assert_matches_reference,
    megatron_steps,
    ppo_batch,
    reference_step,
)

pytestmark = pytest.mark.slow

REAL_VOCAB = 49152
CASE = Case("token-mean", "low_var_kl")


@pytest.fixture(scope="module")
def real_batch_and_reference(real_model):
    batch = ppo_batch(real_model, vocab=REAL_VOCAB)
    reference = reference_step(real_model, batch, CASE)
    assert 0 < reference["clipfrac"] < 0.9 and reference["grad_norm"] > 1e-2  # the step does something
    return batch, reference


@pytest.mark.parametrize("tp, pp", [(1, 1), (3, 1), (1, 2)], ids=["tp1", "tp3", "pp2"])
def test_real_model_ppo_step_equals_transformers(real_model, real_batch_and_reference, tmp_path, tp, pp):
    batch, reference = real_batch_and_reference
    ((metrics, grads),) = megatron_steps(tmp_path, real_model, batch, tp=tp, pp=pp, dp=1,
                                         distributed_optimizer=False, cases=(CASE,))
    assert_matches_reference(reference, metrics, grads, f"tp{tp} pp{pp}")
