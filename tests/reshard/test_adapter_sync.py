"""vLLM serving a LoRA actor's adapters itself (`actor_rollout_ref.model.lora.merge: false`,
`hybridrl.reshard.adapter_sync`), on real forked ranks with the hybrid engine's worker.

The frozen base goes into vLLM once; each later sync moves the adapters alone (the whole adapter to every rank: the
other stages' part over PP). What vLLM then serves is checked against peft on the transformers model (an independent
reference: the log-probs of a fixed sequence, fp32 <= 1e-4), and the sync's own proof (digests of what vLLM's LoRA
manager loaded) is shown to catch a wrong adapter.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.config import plan_from_sources
from hybridrl.config.plan import lora_elements_per_layer
from hybridrl.models.lora_targets import PROJECTIONS as LAYER_PROJECTIONS
from hybridrl.models.lora_targets import TARGETS
from tests.support.colocated_workers import colocated_worker
from tests.support.forked import run_ranks
from tests.support.lora_adapters import adapter_state, shared_a

pytestmark = pytest.mark.slow

RANK, ALPHA = 8, 16
TOKENS = [1, 40, 41, 42, 50, 51, 60, 61, 62, 70, 71, 3, 4, 5]
SMALL_BATCHES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.train_batch_size=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tools.make_demo_model import build

    return str(build("configs/models/tiny-demo/config.json", tmp_path_factory.mktemp("tiny") / "model", seed=3))


def _served_rank(rank: int, world: int, model_dir: str, overrides: list[str], state: dict[str, torch.Tensor],
                 scratch: str) -> dict[str, Any]:
    from hybridrl.models.lora import load_lora_state, lora_adapters, save_peft_adapter
    from hybridrl.reshard.adapter_sync import served_adapter_digests
    from hybridrl.reshard.checksums import ShardChecksumError, verify_checksums

    worker = colocated_worker(rank, world, model_dir, overrides)
    setup = worker.setup(total_training_steps=4)
    settings = worker.actor.backend.spec.lora
    load_lora_state(lora_adapters(worker.actor.backend.chunks), state)  # as if an update had trained them
    base_before = worker.rollout.parameter_digests()
    sync = worker.sync_weights()
    out: dict[str, Any] = {
        "setup": setup, "sync": sync, "base_unchanged": worker.rollout.parameter_digests() == base_before,
        "served": worker.rollout.prompt_log_probs(TOKENS),  # collective over the replica's TP ranks
        "adapter_id": worker.rollout.adapter.lora_int_id}
    # The negative control: vLLM serving another adapter (B doubled) fails the sync's digest check and its probe.
    wrong = {name: t * 2 if ".lora_B." in name else t.clone() for name, t in state.items()}
    worker.rollout.serve_adapter(save_peft_adapter(wrong, settings, Path(scratch) / f"wrong{rank}"), version=99)
    try:
        verify_checksums(served_adapter_digests(state, settings.scaling, torch.float32),
                         worker.rollout.adapter_digests(), rank)
        out["wrong_caught"] = None
    except ShardChecksumError as error:
        out["wrong_caught"] = str(error)
    out["wrong_probe"] = worker._probe_gap()
    return out


def _peft_log_probs(model_dir: str, state: dict[str, torch.Tensor] | None) -> list[float]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[
            p for projections in LAYER_PROJECTIONS.values() for p in projections]))
        peft.set_peft_model_state_dict(model, state)
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits.float()
    picked = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    return [0.0] + picked.tolist()


@pytest.mark.parametrize("layout, kind", [
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "lora"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=1"], "canonical_lora"),
], ids=["tp2-infer2-fused", "pp2-infer1-canonical"])
def test_vllm_serves_the_adapters_a_sync_moves_them_alone_and_equals_peft(model_dir, tmp_path, layout, kind):
    state = adapter_state(Path(model_dir), 5, rank=RANK)
    state = shared_a(state) if kind == "lora" else state  # type lora: a megatron layer's projections share A
    overrides = [*layout, *SMALL_BATCHES, f"actor_rollout_ref.model.lora.rank={RANK}",
                 f"actor_rollout_ref.model.lora.alpha={ALPHA}", f"actor_rollout_ref.model.lora.type={kind}",
                 "actor_rollout_ref.model.lora.merge=false",
                 f"actor_rollout_ref.model.lora.target_modules=[{','.join(TARGETS[kind])}]"]
    results = run_ranks(_served_rank, 2, model_dir, overrides, state, str(tmp_path), timeout_s=600)
    adapter_bytes = sum(t.numel() * 4 for t in state.values())
    # the plan's figure for what a sync moves (`hybridrl plan` prints it) is that adapter
    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [f"actor_rollout_ref.model.path={model_dir}",
                                                                    "trainer.n_gpus_per_node=2", *overrides])
    lora, model = plan.config.actor_rollout_ref.model.lora, plan.model
    assert 4 * lora_elements_per_layer(lora, model, 1, peft_form=True) * model.num_layers == adapter_bytes
    pp = "pipeline_model_parallel_size=2" in layout[0]
    reference = _peft_log_probs(model_dir, state)
    base = _peft_log_probs(model_dir, None)
    for r in results:
        # set-up wrote the base once (through the resharder: each rank's whole generation shard, checksums proven)
        # and a fresh adapter (B zero) beside it
        assert r["setup"]["reshard/generation_shard_bytes"] > 0 and r["setup"]["reshard/probe_max_abs_gap"] < 1e-4
        # the sync after it: the adapters alone, the whole adapter on every rank; over PP the other stage's half
        sync = r["sync"]
        assert "reshard/bytes_received" not in sync and r["base_unchanged"]
        assert sync["reshard/adapter_bytes"] == adapter_bytes
        assert sync["reshard/adapter_bytes_received"] == (adapter_bytes / 2 if pp else 0)
        assert sync["reshard/probe_max_abs_gap"] < 1e-4
        assert r["adapter_id"] == 2  # version 1's id: a new adapter per sync (vLLM's prefix cache keys by it)
        # what vLLM serves is peft's adapted model, not the base
        served = r["served"]
        assert max(abs(a - b) for a, b in zip(served, reference, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(served, base, strict=True)) > 1e-2
        # a wrong adapter is caught by the sync's digests (every B named) and by the probe
        assert r["wrong_caught"] is not None and "lora_B" in r["wrong_caught"] and "lora_A" not in r["wrong_caught"]
        assert r["wrong_probe"] > 1e-2
