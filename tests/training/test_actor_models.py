"""Training (not only loading) Qwen2 (qkv bias), Qwen3 (q/k norm) and tied embeddings on sharded layouts.

One PPO update of each family at TP2, and of a tied-embedding model at PP2 (and TP2 x PP2), against
two references: the single-rank update (every HF tensor after the optimizer step, <= 1e-5 fp32) and
the objective recomputed from transformers in `test_training_actor_reference` (loss terms, grad norm
and every gradient before the step). With tied embeddings at PP > 1 the first stage's embedding and
the last stage's output layer are two copies of one HF tensor: after the step they must be equal,
bit for bit, and equal to the exported `embed_tokens`. That vLLM then serves the trained copies is
in `tests/workers/test_colocated_tied.py` (slow).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.actor_reference import (
    Case,
    actor_config,
    assert_matches_reference,
    gradients_into_params,
    ppo_batch,
    reference_step,
)
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, read_json, safetensors_state
from tests.support.rank_passes import tied_copies

CASE = Case("token-mean", "low_var_kl")
WEIGHT_ATOL = 1e-5




def _train_rank(rank: int, world: int, config: Any, batch: Any, weights_dir: str, grads_dir: str) -> dict:
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    metrics = MegatronActor(backend, plan).update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    export_hf(backend.chunks, weights_dir, force=True)
    copies = tied_copies(backend)  # a TP collective: every rank gathers
    gradients_into_params(backend)
    export_hf(backend.chunks, grads_dir, force=True)
    return {"metrics": metrics, "copies": copies}


def _train(tmp_path: Path, hf: Path, batch: Any, *, tp: int, pp: int) -> dict[str, Any]:
    name = f"tp{tp}pp{pp}"
    weights, grads = tmp_path / f"{name}_weights", tmp_path / f"{name}_grads"
    config = actor_config(hf, CASE, tp=tp, pp=pp)
    # Adam's first step is lr * g / (|g| + eps): its slope at g ~ 0 is lr / eps, so with the
    # fixtures' eps (1e-5) and HF-init weights (5% of gradient entries below 1e-5) float32
    # summation-order noise of ~1e-8 in g becomes ~1e-5 in the weights. The gradients themselves are
    # compared before the step; eps 1e-3 keeps the after-step comparison well-conditioned.
    config.actor_rollout_ref.actor.optim.eps = 1e-3
    results = run_ranks(_train_rank, tp * pp, config, batch, str(weights), str(grads))
    copies: dict[str, torch.Tensor] = {}
    for r in results:
        for role, value in r["copies"].items():
            assert role not in copies or torch.equal(copies[role], value)  # TP peers agree
            copies[role] = value
    return {"metrics": next(r["metrics"] for r in results if r["metrics"] is not None), "copies": copies,
            "weights": safetensors_state(weights), "grads": safetensors_state(grads)}


def _check_family(tmp_path: Path, arch: str, layouts: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    hf = make_hf_model(tmp_path / "hf", arch)
    batch = ppo_batch(hf)
    expected = reference_step(hf, batch, CASE)
    initial = safetensors_state(hf)
    single = _train(tmp_path, hf, batch, tp=1, pp=1)
    runs = {(1, 1): single}
    for tp, pp in layouts:
        runs[(tp, pp)] = _train(tmp_path, hf, batch, tp=tp, pp=pp)
    for layout, run in runs.items():
        assert_matches_reference(expected, run["metrics"], run["grads"], f"{arch} tp,pp={layout}")
        assert sorted(run["weights"]) == sorted(initial)
        for name, value in single["weights"].items():
            err = float((run["weights"][name] - value).abs().max())
            assert err <= WEIGHT_ATOL, (arch, layout, name, err)
    assert min(float((single["weights"][n] - initial[n]).abs().max()) for n in initial) > 1e-4  # every tensor moved
    return runs


def test_qwen2_qkv_bias_trains_at_tp2(tmp_path):
    runs = _check_family(tmp_path, "qwen2", ((2, 1),))
    assert read_json(tmp_path / "hf" / "config.json")["model_type"] == "qwen2"
    biases = [n for n in runs[(2, 1)]["grads"] if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) == 3 * 4  # the qkv biases are trained (and compared) in every layer


def test_qwen3_qk_norm_trains_at_tp2(tmp_path):
    runs = _check_family(tmp_path, "qwen3", ((2, 1),))
    norms = [n for n in runs[(2, 1)]["grads"] if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * 4


def test_tied_embeddings_train_at_pp2(tmp_path):
    runs = _check_family(tmp_path, "qwen2", ((1, 2), (2, 2)))
    assert read_json(tmp_path / "hf" / "config.json")["tie_word_embeddings"] is True
    assert "lm_head.weight" not in runs[(1, 1)]["weights"]  # one HF tensor for both uses
    vocab = read_json(tmp_path / "hf" / "config.json")["vocab_size"]
    for layout in ((1, 2), (2, 2)):
        copies, weights = runs[layout]["copies"], runs[layout]["weights"]
        assert sorted(copies) == ["embedding", "output_layer"], layout
        assert torch.equal(copies["embedding"], copies["output_layer"]), layout  # the copies stayed one tensor
        assert torch.equal(copies["embedding"][:vocab], weights["model.embed_tokens.weight"]), layout
