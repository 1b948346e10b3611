"""Workers on forked gloo ranks (no Ray): the actor's log-probs and PPO update against references."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model
from tests.support.training_fixtures import hf_response_log_probs, job_config, policy_model, rollout_batch, update_rank


def _log_prob_rank(rank: int, world: int, config: Any, batch: Any, role: str = "actor",
                   vpp: int | None = None) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    spec = role_spec(plan, role)
    if vpp:  # a forward-only backend alone in its process: a plan refuses a ref layout unlike the actor's
        spec = dataclasses.replace(spec, megatron=dataclasses.replace(
            spec.megatron, virtual_pipeline_model_parallel_size=vpp))
    backend = MegatronBackend(spec)
    actor = MegatronActor(backend, plan, output_key="old_log_probs")
    out = actor.compute_log_prob(batch, with_entropy=True)
    return None if out is None else {k: v.clone() for k, v in out.tensors.items()}


def test_log_probs_tp2_pp2_equal_transformers(tmp_path):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    # PP2 x VPP2 as the (forward-only) reference role: training refuses VPP with two stages.
    for tp, pp, vpp, role in ((1, 1, None, "actor"), (2, 2, None, "actor"), (1, 2, 2, "ref")):
        config = job_config(hf, world=tp * pp, tp=tp, pp=pp, use_kl_loss=True)
        results = run_ranks(_log_prob_rank, tp * pp, config, batch, role, vpp)
        out = [r for r in results if r is not None]
        assert len(out) == 1
        lp, ent = out[0]["old_log_probs"], out[0]["entropys"]
        assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)
        assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0)


# (tp, pp, dp, vpp, distributed optimizer, sequence parallelism); the first is the single-rank reference.
# TP2 x PP2 with SP: the activations between stages are split along the sequence over TP (megatron's
# own SP code on gloo, the norms' CPU stand-in tagging their weights for the TP gradient sum).
LAYOUTS = ((1, 1, 1, None, False, False), (2, 2, 1, None, False, False), (2, 1, 2, None, True, False),
           (1, 2, 2, None, False, False), (2, 2, 1, None, False, True))


def test_ppo_update_same_across_layouts(tmp_path):
    """Loss, grad norm and updated weights of one PPO step do not depend on the layout; DP replicas agree."""
    from tests.support.models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    runs = {}
    for tp, pp, dp, vpp, distributed, sp in LAYOUTS:
        world = tp * pp * dp
        out = tmp_path / f"out_{tp}{pp}{dp}{vpp}{sp}"
        config = job_config(hf, world=world, tp=tp, pp=pp, vpp=vpp, distributed_optimizer=distributed,
                            use_kl_loss=True, entropy_coeff=0.01)
        config.actor_rollout_ref.actor.megatron.sequence_parallel = sp
        results = run_ranks(update_rank, world, config, batch, str(out))
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == dp
        by_position: dict[Any, set] = {}
        for r in results:
            tp_rank, pp_rank, _ = r["coords"]
            by_position.setdefault((tp_rank, pp_rank), set()).add(tuple(sorted(r["digests"].items())))
        assert all(len(v) == 1 for v in by_position.values()), "DP replicas differ"
        runs[(tp, pp, dp, vpp, distributed, sp)] = (metrics[0], safetensors_state(out))
    base_metrics, base_state = runs[LAYOUTS[0]]
    initial = safetensors_state(hf)
    for key, (metrics, state) in runs.items():
        assert abs(metrics.pg_loss - base_metrics.pg_loss) < 1e-5, key
        assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-5
        assert abs(metrics.kl_loss - base_metrics.kl_loss) < 1e-5
        for name, value in base_state.items():
            assert (state[name] - value).abs().max() < 1e-5, (key, name)
    assert max((base_state[n] - initial[n]).abs().max() for n in initial) > 1e-3  # the update moved weights


def test_ppo_update_on_the_cuda_weight_gradient_path_is_the_same(tmp_path):
    """issue 41 item 8: the CPU default for trained roles is the stand-in for Apex's fused weight-gradient
    accumulation; CUDA without Apex runs megatron's unfused path (a grad tensor, then DDP's accumulation).
    One layout per family (TP x PP with SP, TP x DP with the distributed optimizer, PP x DP) on that path
    gives the single-rank fused reference's update."""
    from tests.support.models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    states = {}
    for tp, pp, dp, vpp, distributed, sp in (LAYOUTS[0], LAYOUTS[4], LAYOUTS[2], LAYOUTS[3]):
        reference = (tp, pp, dp) == (1, 1, 1)
        out = tmp_path / f"out_{tp}{pp}{dp}{sp}"
        config = job_config(hf, world=tp * pp * dp, tp=tp, pp=pp, vpp=vpp, distributed_optimizer=distributed,
                            use_kl_loss=True, entropy_coeff=0.01)
        config.actor_rollout_ref.actor.megatron.sequence_parallel = sp
        results = run_ranks(update_rank, tp * pp * dp, config, batch, str(out), not reference)
        metrics = next(r["metrics"] for r in results if r["metrics"] is not None)
        states[(tp, pp, dp)] = (metrics, safetensors_state(out))
    base_metrics, base_state = states[(1, 1, 1)]
    for key, (metrics, state) in states.items():
        assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-5, key
        for name, value in base_state.items():
            assert (state[name] - value).abs().max() < 1e-5, (key, name)


def test_ppo_update_is_split_invariant(tmp_path):
    """Micro-batch size, dynamic token-budget batching and DP do not change the step (global normalizers)."""
    from tests.support.models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=4)
    cases = {
        "micro4_dp1": (1, dict(micro=4)),
        "micro1_dp2": (2, dict(micro=1)),
        "dynamic_dp2": (2, dict(micro=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)),
        "seq_mean_dp2": (2, dict(micro=1, loss_agg_mode="seq-mean-token-mean")),
        "seq_mean_dp1": (1, dict(micro=4, loss_agg_mode="seq-mean-token-mean")),
    }
    runs = {}
    for name, (dp, kwargs) in cases.items():
        out = tmp_path / name
        results = run_ranks(update_rank, dp, job_config(hf, world=dp, **kwargs), batch, str(out))
        runs[name] = ([r["metrics"] for r in results if r["metrics"] is not None][0], safetensors_state(out))
    for group in (("micro4_dp1", "micro1_dp2", "dynamic_dp2"), ("seq_mean_dp1", "seq_mean_dp2")):
        base_metrics, base_state = runs[group[0]]
        for name in group[1:]:
            metrics, state = runs[name]
            assert abs(metrics.pg_loss - base_metrics.pg_loss) < 1e-6, name
            assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-6, name
            assert abs(metrics.clipfrac - base_metrics.clipfrac) < 1e-6, name
            assert abs(metrics.entropy - base_metrics.entropy) < 1e-6, name
            assert max(float((state[n] - base_state[n]).abs().max()) for n in base_state) < 1e-5, name
    assert abs(runs["micro4_dp1"][0].pg_loss - runs["seq_mean_dp1"][0].pg_loss) > 1e-4  # the modes differ


def _dynamic_log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.micro_batching import partition_rows

    plan = build_plan(config)
    actor = MegatronActor(MegatronBackend(role_spec(plan, "actor")), plan)
    ctx = actor.backend.ctx
    chunk = batch.split(ctx.dp)[ctx.dp_rank]
    parts = partition_rows(chunk["attention_mask"], 0, dynamic=True, max_tokens=actor.max_tokens,
                           dp_group=ctx.dp_group)
    out = actor.compute_log_prob(chunk)
    return {"parts": parts, "log_probs": None if out is None else out["old_log_probs"].clone()}


def test_dynamic_batching_log_probs_keep_row_order(tmp_path):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=6)
    expected, _ = hf_response_log_probs(hf, batch)
    config = job_config(hf, world=2, pp=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24)
    results = run_ranks(_dynamic_log_prob_rank, 2, config, batch)
    assert results[0]["parts"] == results[1]["parts"]  # PP peers cut the rows alike
    assert len(results[0]["parts"]) > 1
    assert sorted(sum(results[0]["parts"], [])) == list(range(8))
    assert (results[1]["log_probs"] - expected).abs().max() < 1e-5


def test_ppo_update_with_interleaved_pipeline(tmp_path):
    """PP4 x VPP2 (8 layers, interleaved 1F1B) gives the single-rank step; PP2 x VPP2 training is refused."""
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.plan import build_plan
    from tests.support.models_fixtures import safetensors_state

    hf = make_hf_model(tmp_path / "hf8", "llama", num_hidden_layers=8)
    batch = rollout_batch(8)
    runs = {}
    for pp, vpp in ((1, None), (4, 2)):
        out = tmp_path / f"pp{pp}"
        results = run_ranks(update_rank, pp, job_config(hf, world=pp, pp=pp, vpp=vpp, micro=1), batch, str(out))
        runs[pp] = ([r["metrics"] for r in results if r["metrics"] is not None][0], safetensors_state(out))
    (base, base_state), (vpp_metrics, vpp_state) = runs[1], runs[4]
    assert abs(vpp_metrics.pg_loss - base.pg_loss) < 1e-5
    assert abs(vpp_metrics.grad_norm - base.grad_norm) < 1e-5
    assert max(float((vpp_state[n] - base_state[n]).abs().max()) for n in base_state) < 1e-5
    with pytest.raises(ConfigError, match="needs pipeline_model_parallel_size > 2"):
        build_plan(job_config(hf, world=2, pp=2, vpp=2))


def test_epochs_and_mini_batches_same_across_layouts(tmp_path):
    """2 epochs x 2 mini-batches (4 optimizer steps, warmup lr): TP2 x PP2 follows the single rank step by step."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=8)
    runs = {}
    for tp, pp in ((1, 1), (2, 2)):
        config = job_config(hf, world=tp * pp, tp=tp, pp=pp, ppo_epochs=2, ppo_mini_batch_size=2)
        config.actor_rollout_ref.actor.optim.lr_warmup_steps = 2
        results = run_ranks(update_rank, tp * pp, config, batch, str(tmp_path / f"out{tp}{pp}"))
        runs[tp] = [r["metrics"] for r in results if r["metrics"] is not None][0]
    base, other = runs[1], runs[2]
    assert base.optimizer_steps == other.optimizer_steps == 4
    assert [s["lr"] for s in base.per_step] == [5e-3, 1e-2, 1e-2, 1e-2]
    for a, b in zip(base.per_step, other.per_step):
        for key in ("pg_loss", "grad_norm", "clipfrac", "approx_kl"):
            assert abs(a[key] - b[key]) < 1e-5, key
    # Later steps see the updated policy: the ratio moves away from the first step's.
    assert abs(base.per_step[2]["approx_kl"] - base.per_step[0]["approx_kl"]) > 1e-4


@pytest.mark.slow
def test_bf16_policy_runs_close_to_fp32(tmp_path):
    """bf16 params (megatron's fp16/bf16 optimizer with fp32 master weights, plain and distributed)."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    expected, _ = hf_response_log_probs(hf, batch)
    fp32 = run_ranks(update_rank, 1, job_config(hf, world=1), batch, str(tmp_path / "fp32"))[0]["metrics"]
    for distributed in (False, True):
        config = job_config(hf, world=2, tp=2, distributed_optimizer=distributed)
        config.actor_rollout_ref.actor.megatron.dtype = "bf16"
        log_probs = [r for r in run_ranks(_log_prob_rank, 2, config, batch) if r is not None][0]["old_log_probs"]
        assert log_probs.dtype == torch.float32
        assert (log_probs - expected).abs().max() < 2e-2
        results = run_ranks(update_rank, 2, config, batch, str(tmp_path / f"bf16_{distributed}"))
        metrics = [r["metrics"] for r in results if r["metrics"] is not None][0]
        assert abs(metrics.pg_loss - fp32.pg_loss) < 1e-3
        assert abs(metrics.grad_norm - fp32.grad_norm) < 1e-2


def test_scheduled_lr_reaches_the_optimizer(tmp_path):
    """Adam's first step moves weights by ~lr: with 1000 warmup steps that is lr / 1000, not lr."""
    from tests.support.models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    initial = safetensors_state(hf)
    config = job_config(hf, world=1)
    config.actor_rollout_ref.actor.optim.lr_warmup_steps = 1000
    (result,) = run_ranks(update_rank, 1, config, rollout_batch(8), str(tmp_path / "out"))
    assert result["metrics"].lr == pytest.approx(1e-5)
    moved = max(float((v - initial[n]).abs().max()) for n, v in safetensors_state(tmp_path / "out").items())
    assert 5e-6 < moved < 2e-5


def test_activation_recomputation_gives_the_same_update(tmp_path):
    """model.enable_gradient_checkpointing (megatron full recompute) changes memory, not results."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    runs = []
    for recompute in (False, True):
        config = job_config(hf, world=2, tp=2)
        config.actor_rollout_ref.model.enable_gradient_checkpointing = recompute
        results = run_ranks(update_rank, 2, config, batch, str(tmp_path / f"out{recompute}"))
        runs.append(next(r for r in results if r["metrics"] is not None))
    assert runs[0]["metrics"].pg_loss == pytest.approx(runs[1]["metrics"].pg_loss, abs=1e-6)
    assert runs[0]["metrics"].grad_norm == pytest.approx(runs[1]["metrics"].grad_norm, abs=1e-6)



def _on_policy_rank(rank: int, world: int, config: Any, batch: Any, recompute: bool) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    chunk = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
    if recompute:  # DP only: every rank is an output rank of its own replica
        chunk["old_log_probs"] = actor.compute_log_prob(chunk)["old_log_probs"]
    metrics = actor.update_policy(chunk)
    weights = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(backend.chunks) for n, p in c.named_parameters()}
    return {"metrics": metrics, "weights": weights, "skips_pass": not plan.resolved.old_log_prob_pass}


def test_on_policy_update_without_old_log_prob_pass_equals_recomputed(tmp_path):
    """actor.old_log_prob=auto: the update's own forward stands in for the skipped pass exactly.

    Reference: the same step with `old_log_probs` from the separate forward pass. The rollout-gap
    metric is checked against a planted gap: rollout log-probs = transformers' log-probs, except one
    token (on DP rank 1's rows) moved by 0.25, so the max over DP ranks must be 0.25.
    With the rollout-mismatch correction on, the target of its ratio is the update's own detached
    forward: token TIS capped at 1.1 and a token mask [0.8, 1.25] must act the same as against the
    separate pass (a second planted token, -0.2 on rank 0's rows: rho = e^0.2 = 1.22 is capped; the
    first's rho = e^-0.25 = 0.78 is masked).
    """
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=7)
    del batch.tensors["old_log_probs"]
    ref_lp, _ = hf_response_log_probs(hf, batch)
    rollout_lp = ref_lp.clone()
    rollout_lp[6, 0] += 0.25
    rollout_lp[1, 0] -= 0.2
    batch["rollout_log_probs"] = rollout_lp * batch["response_mask"]
    config = job_config(hf, world=2, entropy_coeff=0.01)
    rc = config.algorithm.rollout_correction
    rc.is_level, rc.is_cap, rc.mask_level, rc.mask_low, rc.mask_high = "token", 1.1, "token", 0.8, 1.25
    runs = {}
    for recompute in (False, True):
        results = run_ranks(_on_policy_rank, 2, config, batch.select(list(batch.tensors)), recompute)
        assert all(r["skips_pass"] for r in results)
        runs[recompute] = results[0]
    skipped, full = runs[False]["metrics"], runs[True]["metrics"]
    assert skipped.clipfrac == 0.0 and abs(skipped.approx_kl) < 1e-12  # the ratio is exactly 1
    for name in ("pg_loss", "grad_norm", "entropy", "clipfrac", "approx_kl"):
        assert abs(getattr(skipped, name) - getattr(full, name)) < 1e-6, name
    assert abs(skipped.rollout_log_prob_abs_diff_max - 0.25) < 1e-5
    # the token mean over both DP ranks: the two planted gaps over every response token
    assert abs(skipped.rollout_log_prob_abs_diff_mean - 0.45 / int(batch["response_mask"].sum())) < 1e-6
    assert full.rollout_log_prob_abs_diff_max is None  # the separate pass measures it (the trainer does)
    assert full.rollout_log_prob_abs_diff_mean is None
    assert skipped.as_dict()["rollout/log_prob_abs_diff_max"] == skipped.rollout_log_prob_abs_diff_max
    assert skipped.as_dict()["rollout/log_prob_abs_diff_mean"] == skipped.rollout_log_prob_abs_diff_mean
    assert skipped.grad_norm > 1e-3
    tokens = int(batch["response_mask"].sum())
    for corrected in (skipped.rollout_correction, full.rollout_correction):
        assert corrected["rollout_correction/is_weight_max"] == pytest.approx(1.1, abs=1e-6)
        assert corrected["rollout_correction/log_ratio_abs_max"] == pytest.approx(0.25, abs=1e-5)
        assert corrected["rollout_correction/masked_token_fraction"] == pytest.approx(1 / tokens, abs=1e-9)
        assert corrected["rollout_correction/masked_seq_fraction"] == pytest.approx(1 / 8, abs=1e-9)
    assert skipped.rollout_correction["rollout_correction/is_weight_mean"] == pytest.approx(
        full.rollout_correction["rollout_correction/is_weight_mean"], abs=1e-6)
    for name, value in runs[True]["weights"].items():
        assert (runs[False]["weights"][name] - value).abs().max() < 1e-6, name


def _off_policy_without_old_rank(rank: int, world: int, config: Any, batch: Any) -> str:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    actor = MegatronActor(MegatronBackend(role_spec(plan, "actor")), plan)
    with pytest.raises(ValueError, match="needs `old_log_probs`") as err:
        actor.update_policy(batch)
    return str(err.value)


def test_update_without_old_log_probs_is_refused_when_off_policy(tmp_path):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=7)
    del batch.tensors["old_log_probs"]
    config = job_config(hf, world=1, ppo_epochs=2)
    assert "optimizer step" in run_ranks(_off_policy_without_old_rank, 1, config, batch)[0]


def _matched_truncation_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    actor = MegatronActor(MegatronBackend(role_spec(plan, "actor")), plan)
    old = actor.compute_log_prob(batch, with_entropy=True)
    # no old-log-prob pass: the correction's target is the truncation of the update's own forward
    no_pass = actor.update_policy(batch)
    # with the pass's columns (the initial weights'; the update above moved the weights, which the
    # correction must not read: its target is the column)
    passed = batch.select(list(batch.tensors))
    for key in ("old_log_probs", "old_log_probs_truncated"):
        passed[key] = old[key]
    with_pass = actor.update_policy(passed)
    return {"old": {k: v.clone() for k, v in old.tensors.items()}, "no_pass": no_pass, "with_pass": with_pass}


def test_matched_truncation_is_the_corrections_target_with_and_without_the_pass(tmp_path):
    """algorithm.rollout_correction.match_truncation at top_k 120, top_p 0.8, temperature 0.7: the
    actor's `old_log_probs_truncated` = transformers' logits under a plain-torch truncation (a sampled
    token outside the kept set: the set extended by it), and the correction's ratio is taken against
    it in both places (the update's forward, the pass's column): rollout log-probs = that target
    except two planted tokens (+0.25, -0.2) give exactly the planted TIS cap, mask and max |log rho|
    (against the whole vocabulary, log rho would be the log of the kept mass on every token)."""
    from tests.support.references import sorted_reference
    from tests.support.training_fixtures import RESPONSE, hf_response_outputs

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=7)
    del batch.tensors["old_log_probs"]
    batch.meta["temperature"] = 0.7
    width = batch["input_ids"].shape[1]
    logits = hf_response_outputs(hf, batch).logits[:, width - RESPONSE - 1: width - 1].float() / 0.7
    flat = logits.reshape(-1, logits.shape[-1])
    kept = sorted_reference(flat, 120, 0.8, exactly_k=False).reshape(logits.shape)
    labels = batch["responses"].unsqueeze(-1)
    mask = batch["response_mask"].bool()
    kept_or_label = kept | torch.zeros_like(kept).scatter(-1, labels, True)
    target = torch.where(kept_or_label, logits, -torch.inf).log_softmax(-1).gather(-1, labels).squeeze(-1)
    outside = ~kept.gather(-1, labels).squeeze(-1) & mask
    target = target * mask
    assert 0 < int(outside.sum()) < int(mask.sum())  # sampled tokens inside and outside the kept set
    rollout_lp = target.clone()
    rollout_lp[6, 0] += 0.25
    rollout_lp[1, 0] -= 0.2
    batch["rollout_log_probs"] = rollout_lp * mask
    config = job_config(hf, world=1, entropy_coeff=0.01)
    config.actor_rollout_ref.rollout.top_k, config.actor_rollout_ref.rollout.top_p = 120, 0.8
    rc = config.algorithm.rollout_correction
    rc.is_level, rc.is_cap, rc.mask_level, rc.mask_low, rc.mask_high = "token", 1.1, "token", 0.8, 1.25
    rc.match_truncation = True
    result = run_ranks(_matched_truncation_rank, 1, config, batch)[0]
    old = result["old"]
    assert (old["old_log_probs_truncated"] - target).abs().max() < 1e-5
    assert torch.equal(old["old_log_probs_outside"], outside)
    full = logits.log_softmax(-1).gather(-1, labels).squeeze(-1) * mask
    assert (old["old_log_probs"] - full).abs().max() < 1e-5  # PPO's old policy: the whole vocabulary
    tokens = int(mask.sum())
    for metrics in (result["no_pass"], result["with_pass"]):
        corrected = metrics.rollout_correction
        assert corrected["rollout_correction/is_weight_max"] == pytest.approx(1.1, abs=1e-6)
        assert corrected["rollout_correction/log_ratio_abs_max"] == pytest.approx(0.25, abs=1e-5)
        assert corrected["rollout_correction/masked_token_fraction"] == pytest.approx(1 / tokens, abs=1e-9)
        assert corrected["rollout_correction/masked_seq_fraction"] == pytest.approx(1 / 8, abs=1e-9)
    assert result["no_pass"].rollout_correction["rollout_correction/truncation_outside_fraction"] == pytest.approx(
        int(outside.sum()) / tokens, abs=1e-9)
