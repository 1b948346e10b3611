"""Shared helpers for the tests/test_training_* and tests/test_workers_* suites (no tests here).

Tiny random HF models (from `models_fixtures`: Llama with GQA, vocab 200 that megatron pads,
4 layers), job configs for a given layout, rollout-shaped batches (left-padded prompts,
right-padded responses, positions as the rollout writes them) and independent references
computed with `transformers` and plain torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.models_fixtures import VOCAB, make_hf_model

PROMPT = 7
RESPONSE = 6


def job_config(model_path: str | Path, *, world: int, tp: int = 1, pp: int = 1, vpp: int | None = None,
               rows: int = 8, micro: int = 2, distributed_optimizer: bool = False, **actor: Any) -> Any:
    """A JobConfig whose step is `rows` sequences (rows/2 prompts x n=2), one mini-batch, on `world` ranks."""
    from hybridrl.config.schema import JobConfig

    c = JobConfig()
    c.trainer.device = "cpu"
    c.trainer.nnodes, c.trainer.n_gpus_per_node = 1, world
    c.actor_rollout_ref.model.path = str(model_path)
    c.data.max_prompt_length, c.data.max_response_length = PROMPT, RESPONSE
    c.data.train_batch_size = rows // 2
    c.actor_rollout_ref.rollout.n = 2
    a = c.actor_rollout_ref.actor
    a.megatron.tensor_model_parallel_size, a.megatron.pipeline_model_parallel_size = tp, pp
    a.megatron.virtual_pipeline_model_parallel_size = vpp
    a.megatron.use_distributed_optimizer = distributed_optimizer
    a.ppo_mini_batch_size = rows // 2
    a.ppo_micro_batch_size_per_gpu = micro
    a.optim.lr = 1e-2
    a.optim.weight_decay = 0.01
    # Adam's first step is ~lr * g / (|g| + eps): with eps=1e-8 a weight whose gradient is ~1e-8
    # (rare vocab rows) turns float32 summation-order noise into ~1e-5 weight differences between
    # layouts. A larger eps keeps the layout comparison well-conditioned.
    a.optim.eps = 1e-5
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = micro
    c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = micro
    for key, value in actor.items():
        setattr(a, key, value)
    return c


def policy_model(folder: Path, seed: int = 0) -> Path:
    return make_hf_model(folder, "llama", seed=seed)


def rollout_batch(rows: int = 8, seed: int = 0, vocab: int = VOCAB, groups: list[int] | None = None) -> Any:
    """Rows `[left-padded prompt | right-padded response]` with the rollout's columns and PPO inputs.

    `groups` (sizes summing to `rows`): consecutive rows of a group share their first row's prompt and uid,
    as GRPO's samples of one prompt; default: every row its own prompt, uid i // 2."""
    from hybridrl.data.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, PROMPT + 1, (rows,), generator=gen)
    response_lengths = torch.randint(1, RESPONSE + 1, (rows,), generator=gen)
    prompt_lengths[0], response_lengths[0] = PROMPT, RESPONSE  # one row with no padding at all
    group_of = [i // 2 for i in range(rows)]
    if groups is not None:
        if sum(groups) != rows:
            raise ValueError(f"groups {groups} do not add up to {rows} rows")
        group_of = [g for g, size in enumerate(groups) for _ in range(size)]
    first = {g: group_of.index(g) for g in set(group_of)}
    pad = 0
    prompts = torch.full((rows, PROMPT), pad, dtype=torch.long)
    responses = torch.full((rows, RESPONSE), pad, dtype=torch.long)
    prompt_mask = torch.zeros(rows, PROMPT, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE, dtype=torch.long)
    for i in range(rows):
        if groups is not None and first[group_of[i]] != i:
            prompt_lengths[i] = prompt_lengths[first[group_of[i]]]
        p, r = int(prompt_lengths[i]), int(response_lengths[i])
        prompts[i, PROMPT - p:] = torch.randint(1, vocab, (p,), generator=gen)
        if groups is not None and first[group_of[i]] != i:
            prompts[i] = prompts[first[group_of[i]]]
        prompt_mask[i, PROMPT - p:] = 1
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=gen)
        response_mask[i, :r] = 1
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    response_positions = positions[:, -1:] + 1 + torch.arange(RESPONSE).unsqueeze(0)
    tensors = {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "position_ids": torch.cat([positions, response_positions], 1),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, RESPONSE, generator=gen) * response_mask,
        "old_log_probs": (-torch.rand(rows, RESPONSE, generator=gen) * 6) * response_mask,
        "ref_log_probs": (-torch.rand(rows, RESPONSE, generator=gen) * 6) * response_mask,
        "values": torch.randn(rows, RESPONSE, generator=gen) * response_mask,
        "returns": torch.randn(rows, RESPONSE, generator=gen) * response_mask,
    }
    return Batch(tensors, {"uid": group_of})


def hf_response_outputs(hf_dir: Path, batch: Any, model_cls: str = "AutoModelForCausalLM") -> torch.Tensor:
    """transformers' forward on the padded rows as given (attention_mask + position_ids), eager attention."""
    import transformers

    model = getattr(transformers, model_cls).from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], output_hidden_states=True)
    return out


def hf_response_log_probs(hf_dir: Path, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) `[B, R]` of the response tokens, 0 on padding, from HF's full logits."""
    logits = hf_response_outputs(hf_dir, batch).logits
    width = batch["input_ids"].shape[1]
    pred = logits[:, width - RESPONSE - 1: width - 1].float()
    log_softmax = pred.log_softmax(-1)
    log_probs = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = batch["response_mask"].float()
    return log_probs * mask, entropy * mask


def sequence_classifier(folder: Path, seed: int = 1) -> Path:
    """A tiny random `LlamaForSequenceClassification` (num_labels=1, pad id 0) saved to `folder`."""
    import transformers

    from tests.support.models_fixtures import _COMMON

    config = transformers.LlamaConfig(**_COMMON, num_labels=1, pad_token_id=0,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def with_critic(config: Any, critic_path: str | Path, *, tp: int = 1, pp: int = 1) -> Any:
    """Enable a critic (GAE) on the same ranks, from `critic_path`, with a plain Adam like the actor's."""
    c = config
    c.algorithm.adv_estimator = "gae"
    c.critic.model.path = str(critic_path)
    c.critic.megatron.tensor_model_parallel_size, c.critic.megatron.pipeline_model_parallel_size = tp, pp
    c.critic.megatron.use_distributed_optimizer = False
    c.critic.ppo_micro_batch_size_per_gpu = c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    c.critic.optim.lr, c.critic.optim.eps, c.critic.optim.weight_decay = 1e-2, 1e-5, 0.0
    c.critic.cliprange_value = 0.2
    return c


def with_reward_model(config: Any, rm_path: str | Path, *, tp: int = 1, pp: int = 1) -> Any:
    c = config
    c.reward_model.enable = True
    c.reward_model.model.path = str(rm_path)
    c.reward_model.megatron.tensor_model_parallel_size, c.reward_model.megatron.pipeline_model_parallel_size = tp, pp
    c.reward_model.micro_batch_size_per_gpu = 2
    return c


def trained_role(config: Any, role: str, batches: list[Any]) -> tuple[Any, Any, list[Any]]:
    """In a forked rank: the role's backend, its update function and this DP rank's share of each batch."""
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.critic import MegatronCritic

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, role))
    worker: Any = MegatronActor(backend, plan) if role == "actor" else MegatronCritic(backend, plan)
    update = worker.update_policy if role == "actor" else worker.update_critic
    ctx = backend.ctx
    return backend, update, [b.split(ctx.dp)[ctx.dp_rank] for b in batches]


def update_rank(rank: int, world: int, config: Any, batch: Any, out_dir: str, cuda_wgrad: bool = False) -> Any:
    """One PPO update of the actor in a forked rank on `config`'s layout, its DP chunk of `batch`: the metrics, the
    rank's coordinates and the digests of its parameters; the updated model exported to `out_dir`."""
    import dataclasses

    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.models.checkpoint import tensor_sha256
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    spec = role_spec(plan, "actor")
    if cuda_wgrad:  # the weight-gradient path CUDA takes without Apex: megatron's unfused GEMM + add into main_grad
        spec = dataclasses.replace(spec, device_policy=dataclasses.replace(spec.device_policy,
                                                                           wgrad_accumulation_fusion=None))
    backend = MegatronBackend(spec)
    if rank == 0:
        assert backend.config.gradient_accumulation_fusion is (not cuda_wgrad)
    actor = MegatronActor(backend, plan)
    ctx = backend.ctx
    chunk = batch.split(ctx.dp)[ctx.dp_rank]
    metrics = actor.update_policy(chunk)
    export_hf(backend.chunks, out_dir, force=True)
    digests = {f"{i}.{n}": tensor_sha256(p.detach())
               for i, c in enumerate(backend.chunks) for n, p in c.named_parameters()}
    return {"metrics": metrics, "coords": (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank), "digests": digests}
