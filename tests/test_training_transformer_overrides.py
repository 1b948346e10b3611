"""`override_transformer_config` reaches megatron: activation recompute set there (verl's
recompute_granularity / recompute_method / recompute_num_layers) recomputes, and the update is the same.

Real megatron-core on gloo ranks; the observation is megatron's own: how often a decoder layer's MLP runs
in one update (once per micro-batch forward, once more per micro-batch when its layer is recomputed in the
backward pass), and the model's TransformerConfig.
"""
from __future__ import annotations

from typing import Any

import pytest

from hybridrl.parallel.forked import run_ranks
from tests.test_training_fixtures import job_config, policy_model, rollout_batch

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
