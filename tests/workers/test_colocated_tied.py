"""A tied-embedding Qwen2 trained at PP2 on the hybrid engine: vLLM serves the trained, still-tied weights.

Two forked gloo ranks: the megatron actor at PP2 (the embedding on stage 0, its copy as the output
layer on stage 1) and two vLLM replicas (rollout TP1, one per rank). Two steps of generate → old
log-probs → PPO update → weight sync; then, on every rank, the two megatron copies are equal bit for
bit, and each replica's log-probs of a fixed sequence equal transformers' on the exported trained
model (fp32, <= 1e-4), away from the initial model's: vLLM got the trained weights, and one
embedding serves as both input and output.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import safetensors_state
from tests.support.rollout_models import QWEN2_TIED, build_tiny_model

pytestmark = pytest.mark.slow

SEQUENCE = [1, 70, 71, 72, 9, 33, 101, 5, 64, 17, 120, 2]  # ids < QWEN2_TIED's vocab (130)
STEPS = 2


def _tied_pp2_rank(rank: int, world: int, model_dir: str, export_dir: str) -> dict:
    from hybridrl.data.batch import Batch
    from hybridrl.models.bridge import export_hf
    from hybridrl.rollout.sampling import RolloutSampling
    from tests.support.colocated_workers import colocated_worker, gather_first
    from tests.support.rank_passes import tied_copies

    worker = colocated_worker(rank, world, model_dir, [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.actor.old_log_prob=recompute",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=64"])
    plan = worker.plan
    worker.setup(total_training_steps=STEPS)
    assert worker.resharder.config.bucket_bytes == 64 << 20  # the Plan's sync bucket reaches the resharder
    n = plan.config.actor_rollout_ref.rollout.n
    probes, grad_norms = [], []
    for step in range(STEPS):
        prompts = Batch({"input_ids": torch.zeros(2, 5, dtype=torch.long)},
                        {"raw_prompt_ids": [[1, 70, 71, 72], [1, 73, 74, 75, 76]], "uid": ["a", "b"]})
        sampling = RolloutSampling(n=n, max_tokens=8, temperature=1.0, seed=step)
        # rank 0's replica samples the step's batch (TP1 engines generate alone); both stages train on it
        batch = gather_first(worker.generate_sequences(prompts, sampling) if rank == 0 else None, world)
        batch.meta["temperature"] = 1.0
        batch["old_log_probs"] = gather_first(worker.compute_log_prob(batch), world)["old_log_probs"]
        advantages = torch.tensor(np.linspace(-1.0, 1.0, len(batch)), dtype=torch.float32)
        batch["advantages"] = advantages[:, None] * batch["response_mask"].float()
        grad_norms.append(gather_first(worker.update_actor(batch), world).grad_norm)
        probes.append(worker.sync_weights()["reshard/probe_max_abs_gap"])
    export_hf(worker.actor.backend.chunks, export_dir, force=True)
    return {"copies": tied_copies(worker.actor.backend), "probes": probes, "grad_norms": grad_norms,
            "vllm_log_probs": worker.rollout.prompt_log_probs(SEQUENCE)[1:]}


def _hf_log_probs(model_dir: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([SEQUENCE])).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(SEQUENCE[1:]).unsqueeze(-1)).squeeze(-1)


def test_tied_model_trained_at_pp2_reaches_every_vllm_replica(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", QWEN2_TIED, seed=5)
    export_dir = tmp_path / "trained"
    results = run_ranks(_tied_pp2_rank, 2, str(model_dir), str(export_dir), timeout_s=600)
    trained = safetensors_state(export_dir)
    assert "lm_head.weight" not in trained  # tied: one HF tensor
    embedding = trained["model.embed_tokens.weight"]
    copies = {}
    for r in results:
        assert all(p < 1e-4 for p in r["probes"]) and all(g > 0 for g in r["grad_norms"]), r
        copies.update(r["copies"])
    # stage 0 holds the embedding, stage 1 the output layer: one trained tensor in two places
    assert sorted(copies) == ["embedding", "output_layer"]
    assert torch.equal(copies["embedding"], copies["output_layer"])
    assert torch.equal(copies["embedding"][:QWEN2_TIED["vocab_size"]], embedding)
    assert float((embedding - safetensors_state(model_dir)["model.embed_tokens.weight"]).abs().max()) > 1e-3
    expected, initial = _hf_log_probs(export_dir), _hf_log_probs(model_dir)
    assert float((expected - initial).abs().max()) > 1e-3  # training moved the policy
    for r in results:  # every replica serves the trained weights
        served = torch.tensor(r["vllm_log_probs"])
        assert float((served - expected).abs().max()) < 1e-4, r["vllm_log_probs"]
