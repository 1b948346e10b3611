"""Context parallelism on CPU: the attention stand-in's all-gathered keys and values, megatron's
load-balanced sequence split, and the training backend at CP2 against CP1 and transformers.

The references are independent of the code under test: plain torch attention over the whole sequence
(written here), transformers' per-row log-probs, and the same job at CP1.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.parallel.context_parallel import cp_columns
from hybridrl.parallel.forked import run_ranks
from tests.test_training_packing import torch_causal_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_cp_columns_are_megatrons_load_balanced_chunks():
    # 16 columns, CP2: four chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_columns(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_columns(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # CP4 over 8 columns: chunk size 1, rank r holds r and 7 - r
    assert [cp_columns(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="2 × CP = 4"):
        cp_columns(10, 2, 0)


def _attention_rank(rank: int, world: int, seq: int, batch: int) -> dict[str, Any]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu_attention import cpu_packed_attention_class
    from hybridrl.parallel.cpu_layer import CPU_CONFIG_OVERRIDES

    ctx = state.initialize_model_parallel(tp=1, cp=world, device="cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, context_parallel_size=world,
                               attention_dropout=0.0, hidden_dropout=0.0, **CPU_CONFIG_OVERRIDES)
    # the whole sequence, the same on every rank; each rank takes its columns
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(seq, batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(seq, batch, KV_HEADS, HEAD_DIM, generator=gen)
    weight = torch.randn(seq, batch, HEADS * HEAD_DIM, generator=gen)
    columns = cp_columns(seq, world, ctx.cp_rank)
    # `.cuda()`: where megatron's activations live (a no-op under the CPU layer; strict-device mode tags
    # them as device tensors, so the gathers are checked as NCCL would check them)
    local = [t[columns].cuda().clone().requires_grad_(True) for t in (q, k, v)]
    stand_in = cpu_packed_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
    out = stand_in(*local, None, attn_mask_type=AttnMaskType.causal)
    # the CP ranks' losses add up to the whole sequence's: the gradient of a key sums over every rank's queries
    (out * weight[columns].cuda()).sum().backward()

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.stack([torch_causal_attention(*(t[:, i] for t in full)) for i in range(batch)], dim=1)
    (ref * weight).sum().backward()
    refused = None
    try:
        DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    except AssertionError as err:
        refused = str(err)
    # the backend's split of a [b, s] batch is megatron-core's own helper's, on the real CP group
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from hybridrl.parallel.context_parallel import split_for_cp_rank

    ids = torch.arange(batch * seq).reshape(batch, seq)
    megatron_split = get_batch_on_this_cp_rank({"tokens": ids.clone()},
                                               parallel_state.get_context_parallel_group())["tokens"]
    with torch.no_grad():  # the local queries against the local keys only: the test can tell the gather
        alone = super(type(stand_in), stand_in).forward(*(t.detach() for t in local), None,
                                                         attn_mask_type=AttnMaskType.causal)
    out, alone, grads = out.cpu(), alone.cpu(), [a.grad.cpu() for a in local]
    return {
        "shape": tuple(out.shape),
        "out_vs_torch": float((out - ref[columns]).abs().max()),
        "grad_vs_torch": [float((g - b.grad[columns]).abs().max()) for g, b in zip(grads, full)],
        "grad_scale": min(float(g.abs().max()) for g in grads),
        "local_only_gap": float((alone - ref[columns].detach()).abs().max()),
        "megatron_refuses": refused,
        "split_is_megatrons": torch.equal(split_for_cp_rank(ids, 1, world, ctx.cp_rank), megatron_split),
    }


def test_cpu_attention_stand_in_under_cp2_equals_plain_torch():
    """CP2, GQA (4 query heads, 2 KV heads), two sequences of 12 columns: output and q/k/v grads."""
    results = run_ranks(_attention_rank, 2, 12, 2)
    for r in results:
        assert r["shape"] == (6, 2, HEADS * HEAD_DIM)
        assert r["out_vs_torch"] < 1e-6, r
        assert max(r["grad_vs_torch"]) < 1e-5 and r["grad_scale"] > 1e-2, r
        assert r["local_only_gap"] > 1e-2
        assert r["megatron_refuses"] is not None and "Context parallelism" in r["megatron_refuses"]
        assert r["split_is_megatrons"]


# ---- the training backend: CP2 = CP1 = transformers --------------------------------------------------
TOL = 1e-5


def with_cp(config: Any, cp: int) -> Any:
    config.actor_rollout_ref.actor.megatron.context_parallel_size = cp
    config.critic.megatron.context_parallel_size = cp
    return config


def _log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    out = MegatronActor(backend, plan).compute_log_prob(batch, with_entropy=True)
    micro = backend.micro_batches(batch.tensors, [[0, 1, 2, 3]])[0]
    return {"out": None if out is None else {k: v.clone() for k, v in out.tensors.items()},
            "cp": (backend.ctx.cp, backend.ctx.cp_rank), "width": micro.seq_length}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_cp2_log_probs_and_entropy_equal_cp1_and_transformers(tmp_path, tp, pp):
    """Rows 0-3 hold a full row (13 columns): at CP2 the micro-batch is padded to 16 = 4 chunks of 4.
    With TP2 (vocab-parallel log-probs) and PP2 (the last stage gathers, activations go on local)."""
    from tests.test_training_fixtures import hf_response_log_probs, job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=9)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    runs = {}
    for cp in (1, 2):
        world = tp * pp * cp
        config = with_cp(job_config(hf, world=world, tp=tp, pp=pp, micro=4), cp)
        results = run_ranks(_log_prob_rank, world, config, batch)
        assert sorted(r["cp"] for r in results) == sorted((cp, r % cp) for r in range(world))
        assert all(r["width"] == (13 if cp == 1 else 16) for r in results)
        outs = [r["out"] for r in results if r["out"] is not None]
        assert len(outs) == 1  # CP rank 0 answers
        runs[cp] = outs[0]
    for key, ref in (("old_log_probs", ref_lp), ("entropys", ref_ent)):
        assert (runs[2][key] - runs[1][key]).abs().max() <= TOL, key
        assert (runs[2][key] - ref).abs().max() <= TOL, key
        assert runs[2][key].abs().max() > 1e-2


def _update_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
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
            "coords": (backend.ctx.tp_rank, backend.ctx.pp_rank)}


@pytest.mark.parametrize("dp", [1, 2])
def test_cp2_update_equals_cp1(tmp_path, dp):
    """One PPO step (KL loss, entropy bonus) at CP2 (and DP2 × CP2): loss, grad norm and every weight of
    every rank equal CP1's at the same DP."""
    from tests.test_training_fixtures import job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=10)
    runs = {}
    for cp in (1, 2):
        config = with_cp(job_config(hf, world=dp * cp, micro=2, use_kl_loss=True, entropy_coeff=0.01), cp)
        results = run_ranks(_update_rank, dp * cp, config, batch)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == dp  # CP rank 0 of each DP rank answers
        runs[cp] = (metrics[0], [r["weights"] for r in results])
        before = results[0]["before"]
    (m1, w1), (m2, w2) = runs[1], runs[2]
    for name in ("pg_loss", "grad_norm", "kl_loss", "entropy", "approx_kl", "clipfrac"):
        assert abs(getattr(m2, name) - getattr(m1, name)) <= TOL, name
    assert m1.grad_norm > 1e-2
    moved = max(float((w1[0][n] - p).abs().max()) for n, p in before.items())
    assert moved > 1e-3  # the step moved the weights: equal weights are a finding
    for weights in w2:  # every CP and DP rank holds CP1's updated weights
        for name, value in w1[0].items():
            assert (weights[name] - value).abs().max() <= TOL, name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_cp2_update_with_tp2_or_pp2_equals_cp1(tmp_path, tp, pp):
    """TP2 × CP2 and PP2 × CP2 (4 ranks) against CP1 on the same TP/PP: loss, grad norm, each shard's weights."""
    from tests.test_training_fixtures import job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=12)
    runs = {}
    for cp in (1, 2):
        world = tp * pp * cp
        config = with_cp(job_config(hf, world=world, tp=tp, pp=pp, micro=2, use_kl_loss=True), cp)
        results = run_ranks(_update_rank, world, config, batch)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == 1
        runs[cp] = (metrics[0], [(r["coords"], r["weights"]) for r in results])
    (m1, w1), (m2, w2) = runs[1], runs[2]
    for name in ("pg_loss", "grad_norm", "kl_loss", "entropy"):
        assert abs(getattr(m2, name) - getattr(m1, name)) <= TOL, name
    assert m1.grad_norm > 1e-2
    cp1 = dict(w1)
    assert sorted(cp1) == sorted({c for c, _ in w2})
    for coords, weights in w2:
        for name, value in cp1[coords].items():
            assert (weights[name] - value).abs().max() <= TOL, (coords, name)


def _critic_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.training.critic import MegatronCritic

    plan = build_plan(config)
    critic = MegatronCritic(MegatronBackend(role_spec(plan, "critic")), plan)
    values = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
    return {"values": None if values is None else values["values"].clone(), "metrics": metrics}


def test_cp2_critic_values_and_update_equal_cp1(tmp_path):
    from tests.test_training_fixtures import job_config, policy_model, rollout_batch, sequence_classifier, with_critic

    hf = policy_model(tmp_path / "hf")
    critic = sequence_classifier(tmp_path / "critic")
    batch = rollout_batch(8, seed=3)
    runs = {}
    for cp in (1, 2):
        config = with_cp(with_critic(job_config(hf, world=cp, micro=4), critic), cp)
        results = [r for r in run_ranks(_critic_rank, cp, config, batch) if r["values"] is not None]
        assert len(results) == 1
        runs[cp] = results[0]
    assert (runs[2]["values"] - runs[1]["values"]).abs().max() <= TOL
    assert runs[1]["values"].abs().max() > 1e-2
    for name in ("vf_loss", "grad_norm", "vpred_mean"):
        assert abs(getattr(runs[2]["metrics"], name) - getattr(runs[1]["metrics"], name)) <= TOL, name


# ---- checkpoints resume across CP sizes ---------------------------------------------------------------
def test_cp2_checkpoint_resumes_on_cp1_and_back(tmp_path):
    """An actor step at CP2 (distributed optimizer: Adam state sharded over DP × CP) saved, resumed at
    CP1 and at CP2: the next step (loss, grad norm, lr, every weight) is the same; a CP1 checkpoint
    resumed at CP2 gives it too. The optimizer state and the weights are CP-invariant."""
    from tests.test_training_checkpoint_layouts import _assert_same_next_step, _config, _rank, _run
    from tests.test_training_fixtures import policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batches = [rollout_batch(8, seed=5), rollout_batch(8, seed=6)]

    def config(cp: int) -> Any:
        return with_cp(_config(hf, tp=1, pp=1, dp=cp, distributed=True), cp)  # world = cp: DP 1

    ckpt2, ckpt1 = tmp_path / "cp2", tmp_path / "cp1"
    run_ranks(_rank, 2, config(2), batches, str(ckpt2), "", "save")
    run_ranks(_rank, 1, config(1), batches, str(ckpt1), "", "save")
    reference = _run(config(2), 2, batches, ckpt2, tmp_path / "ref", "resume")
    assert reference["resharded"] is False
    on_cp1 = _run(config(1), 1, batches, ckpt2, tmp_path / "on_cp1", "resume")
    assert on_cp1["resharded"] is True
    _assert_same_next_step(on_cp1, reference, "cp2 -> cp1")
    from_cp1 = _run(config(2), 2, batches, ckpt1, tmp_path / "from_cp1", "resume")
    _assert_same_next_step(from_cp1, reference, "cp1 -> cp2")


def test_cp2_reward_model_scores_equal_transformers(tmp_path):
    """The reward model at CP2 reads each row's last real column from the gathered sequence."""
    from tests.test_training_critic import _reward_rank, reward_model_case
    from tests.test_training_fixtures import job_config, with_reward_model

    rm, hf, batch, expected = reward_model_case(tmp_path)
    config = with_reward_model(job_config(hf, world=2), rm)
    config.reward_model.megatron.context_parallel_size = 2
    scores = [s for s in run_ranks(_reward_rank, 2, config, batch) if s is not None]
    assert len(scores) == 1
    assert (scores[0] - expected).abs().max() < TOL and expected.abs().max() > 1e-2
