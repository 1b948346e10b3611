"""`override_transformer_config` reaches megatron: activation recompute set there (verl's
recompute_granularity / recompute_method / recompute_num_layers) recomputes, and the update is the same.

Real megatron-core on gloo ranks; the observation is megatron's own: how often a decoder layer's MLP runs
in one update (once per micro-batch forward, once more per micro-batch when its layer is recomputed in the
backward pass), and the model's TransformerConfig.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.support.forked import run_ranks
from tests.support.training_fixtures import job_config, policy_model, rollout_batch

TOL = 1e-5


def _update_counting_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    calls: dict[str, int] = {}
    for chunk in backend.chunks:
        for name, module in chunk.named_modules():
            if name.endswith(".mlp") and ".layers." in name:
                calls[name] = 0
                module.register_forward_hook(lambda m, i, o, key=name: calls.__setitem__(key, calls[key] + 1))
    actor = MegatronActor(backend, plan)
    metrics = actor.update_policy(batch)
    config_of = backend.chunks[0].module.config if hasattr(backend.chunks[0], "module") else backend.chunks[0].config
    weights = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(backend.chunks) for n, p in c.named_parameters()}
    return {"metrics": metrics, "weights": weights, "calls": calls,
            "granularity": config_of.recompute_granularity, "method": config_of.recompute_method}


@pytest.mark.parametrize("settings, recomputed_layers", [
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, "all"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, "first"),
])
def test_megatron_recompute_from_the_config_recomputes_and_keeps_the_update(tmp_path, settings, recomputed_layers):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=21)
    runs = {}
    for on in (False, True):
        config = job_config(hf, world=1, micro=4)
        if on:
            config.actor_rollout_ref.actor.megatron.override_transformer_config = dict(settings)
        (runs[on],) = run_ranks(_update_counting_rank, 1, config, batch)
    plain, recomputed = runs[False], runs[True]
    assert (plain["granularity"], recomputed["granularity"]) == (None, "full")
    assert recomputed["method"] == settings["recompute_method"]
    micro_batches = 8 // 4
    assert set(plain["calls"].values()) == {micro_batches}  # one forward per micro-batch, no recompute
    layers = sorted(recomputed["calls"])
    expected = {name: 2 * micro_batches if recomputed_layers == "all" or i == 0 else micro_batches
                for i, name in enumerate(layers)}
    assert recomputed["calls"] == expected
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert abs(getattr(recomputed["metrics"], name) - getattr(plain["metrics"], name)) <= TOL, name
    for name, value in plain["weights"].items():
        assert (recomputed["weights"][name] - value).abs().max() <= TOL, name


def _optimizer_rank(rank: int, world: int, config: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.offload import inner_optimizers

    backend = MegatronBackend(role_spec(build_plan(config), "actor"))
    return [(type(inner).__name__, inner.defaults["weight_decay"]) for inner in inner_optimizers(backend.optimizer)]


def test_megatron_optimizer_settings_from_the_config_reach_its_optimizer(tmp_path):
    """verl's optim.override_optimizer_config: megatron builds Adam with L2 weight decay instead of AdamW when
    decoupled_weight_decay is false (megatron's own choice of torch optimizer, read back)."""
    hf = policy_model(tmp_path / "hf")
    built = {}
    for decoupled in (None, False):
        config = job_config(hf, world=1, micro=4)
        config.actor_rollout_ref.actor.optim.weight_decay = 0.1
        if decoupled is not None:
            config.actor_rollout_ref.actor.optim.override_optimizer_config = {"decoupled_weight_decay": decoupled}
        (built[decoupled],) = run_ranks(_optimizer_rank, 1, config)
    assert {name for name, _ in built[None]} == {"AdamW"} and {name for name, _ in built[False]} == {"Adam"}
    assert all(decay in (0.0, 0.1) for _, decay in built[False])  # hybridrl's weight decay still applies


def _overlap_rank(rank: int, world: int, config: Any, batch: Any, gather_at_end: bool) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    if not gather_at_end:  # the negative control: an update that leaves megatron's overlapped gather pending
        backend.finish_param_gather = lambda: None
    actor = MegatronActor(backend, plan)
    metrics = actor.update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    ddp = backend.models[0].ddp_config
    weights = {n: p.detach().clone() for n, p in backend.chunks[0].named_parameters()}
    return {"weights": weights, "grad_norm": metrics.grad_norm if metrics else None,
            "overlaps": (ddp.overlap_grad_reduce, ddp.overlap_param_gather)}


def test_megatron_ddp_overlap_keeps_the_update(tmp_path):
    """override_ddp_config (verl's key; on cuda the overlaps are the default): the gradient reduce overlapped with
    the backward and the distributed optimizer's parameter all-gather with the next mini-batch's forward, at DP2
    with two optimizer steps, give the weights of the update without them on every rank. The gather pending after
    the last step is completed by `finish_param_gather`; without it the ranks' weights are stale."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(16, seed=5)
    runs = {}
    for overlap, gather_at_end in ((False, True), (True, True), (True, False)):
        config = job_config(hf, world=2, rows=16, micro=2, distributed_optimizer=True)
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4  # 2 optimizer steps: the gather overlaps the 2nd
        if overlap:
            config.actor_rollout_ref.actor.megatron.override_ddp_config = {
                "overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": 4096}
        runs[overlap, gather_at_end] = run_ranks(_overlap_rank, 2, config, batch, gather_at_end)
    plain, overlapped, pending = runs[False, True], runs[True, True], runs[True, False]
    assert [r["overlaps"] for r in plain] == [(False, False)] * 2
    assert [r["overlaps"] for r in overlapped] == [(True, True)] * 2
    for rank in range(2):
        for name, value in plain[rank]["weights"].items():
            assert (overlapped[rank]["weights"][name] - value).abs().max() <= TOL, (rank, name)
    stale = [name for name, value in plain[0]["weights"].items()
             if (pending[0]["weights"][name] - value).abs().max() > TOL or
             (pending[1]["weights"][name] - value).abs().max() > TOL]
    assert stale, "without finish_param_gather some rank's weights should be a step behind"


def _speed_defaults_rank(rank: int, world: int, config: Any, batch: Any, cuda_defaults: bool) -> Any:
    import dataclasses

    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    spec = role_spec(plan, "actor")
    if cuda_defaults:  # what a cuda job turns on, here on megatron's CPU path (its jit fusions run on CPU)
        spec = dataclasses.replace(spec, device_policy=dataclasses.replace(spec.device_policy,
                                                                           megatron_speed_defaults=True))
    backend = MegatronBackend(spec)
    MegatronActor(backend, plan).update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    ddp = backend.models[0].ddp_config
    reached = {s.name: getattr(backend.config if s.kind == "transformer" else ddp, s.name) for s in backend.speed}
    return {"speed": [(s.name, s.on) for s in backend.speed], "reached": reached,
            "weights": {n: p.detach().clone() for n, p in backend.chunks[0].named_parameters()}}


def test_the_cuda_speed_defaults_reach_megatron_and_keep_the_update(tmp_path):
    """issue 47: the defaults a cuda job gets (`speed_settings`) arrive in megatron's TransformerConfig and
    DistributedDataParallelConfig unchanged, and where a fusion is exact (megatron's jit-fused SwiGLU and
    bias-dropout-add) and with both overlaps, the DP2 update's weights equal those without any of them."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(16, seed=9)
    runs = {}
    for cuda_defaults in (False, True):
        config = job_config(hf, world=2, rows=16, micro=2, distributed_optimizer=True)
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
        runs[cuda_defaults] = run_ranks(_speed_defaults_rank, 2, config, batch, cuda_defaults)
    assert runs[False][0]["speed"] == []  # the CPU layer keeps its own settings
    on = dict(runs[True][0]["speed"])
    # no TransformerEngine or Apex on this machine: their two fusions stay off, the rest are on
    assert on == {"bias_activation_fusion": True, "bias_dropout_fusion": True, "apply_rope_fusion": False,
                  "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
                  "persist_layer_norm": False, "overlap_grad_reduce": True, "overlap_param_gather": True}
    for rank in range(2):
        # the CPU layer's own wgrad stand-in turns megatron's flag on here (the device policy's, not a default)
        assert runs[True][rank]["reached"] == {**on, "gradient_accumulation_fusion": True}
        for name, value in runs[False][rank]["weights"].items():
            assert (runs[True][rank]["weights"][name] - value).abs().max() <= TOL, (rank, name)
