"""Actor passes run in forked ranks by the layout tests (context parallelism, MoE, strict-device): the log-probs of
a batch and one update with every weight before and after; `with_cp` sets a job's context parallelism."""
from __future__ import annotations

from typing import Any

import torch


def with_cp(config: Any, cp: int, packed: bool | None = None) -> Any:
    """`cp` for the actor and critic; `packed` sets every role's use_remove_padding (None: the default)."""
    config.actor_rollout_ref.actor.megatron.context_parallel_size = cp
    config.critic.megatron.context_parallel_size = cp
    if packed is not None:
        for model in (config.actor_rollout_ref.model, config.critic.model, config.reward_model.model):
            model.use_remove_padding = packed
    return config



def log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    """The actor's log-probs and entropy of `batch` on `config`'s layout, with the rank's CP place and its first
    micro-batch's width and packing."""
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    out = MegatronActor(backend, plan).compute_log_prob(batch, with_entropy=True)
    micro = backend.micro_batches(batch.tensors, [[0, 1, 2, 3]])[0]
    return {"out": None if out is None else {k: v.clone() for k, v in out.tensors.items()},
            "cp": (backend.ctx.cp, backend.ctx.cp_rank), "width": micro.seq_length, "packed": micro.is_packed}


def weights_update_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    """One PPO update of the actor's DP chunk of `batch`: its metrics, every weight before and after, the rank's TP/PP
    coordinates."""
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))

    def weights() -> dict[str, torch.Tensor]:
        return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(backend.chunks) for n, p in c.named_parameters()}

    before = weights()
    metrics = MegatronActor(backend, plan).update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    return {"metrics": metrics, "weights": weights(), "before": before,
            "coords": (backend.ctx.tp_rank, backend.ctx.pp_rank),
            "aux_loss_coeff": backend.config.moe_aux_loss_coeff}  # what the routers were given


def tied_copies(backend: Any) -> dict[str, torch.Tensor]:
    """This stage's copies of the tied embedding (full vocab rows, TP shards gathered), by role."""
    import torch.distributed as dist

    ctx = backend.ctx
    found = {}
    for chunk in backend.chunks:
        if chunk.pre_process:
            found["embedding"] = chunk.embedding.word_embeddings.weight
        if chunk.post_process and chunk.output_layer.weight is not None:  # None when PP=1 shares one tensor
            found["output_layer"] = chunk.output_layer.weight
    out = {}
    for role, weight in found.items():
        shards = [torch.empty_like(weight) for _ in range(ctx.tp)]
        dist.all_gather(shards, weight.detach().contiguous(), group=ctx.tp_group)
        out[role] = torch.cat(shards).clone()
    return out
