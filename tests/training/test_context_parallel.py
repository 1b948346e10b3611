"""Context parallelism on CPU: the attention stand-in's all-gathered keys and values, megatron's
load-balanced sequence split (padded micro-batches) and TE's per-segment split (packed ones), and the
training backend at CP2, padded and packed, against the padded CP1 path and transformers.

The references are independent of the code under test: plain torch attention over each whole sequence
(written here), megatron's own unfused THD RoPE, transformers' per-row log-probs, and the same job at
CP1 on padded micro-batches.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.parallel.context_parallel import cp_columns
from tests.support.forked import run_ranks
from tests.support.rank_passes import log_prob_rank, weights_update_rank, with_cp
from tests.support.references import torch_causal_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_cp_columns_are_megatrons_load_balanced_chunks():
    # 16 columns, CP2: four chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_columns([0, 16], 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_columns([0, 16], 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # CP4 over 8 columns: chunk size 1, rank r holds r and 7 - r
    assert [cp_columns([0, 8], 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="2 × CP = 4"):
        cp_columns([0, 10], 2, 0)


def test_cp_columns_of_packed_segments_are_tes_thd_partition():
    """TE's `thd_get_partitioned_indices` order, written out: segments of 8, 4 and 12 columns at CP2
    (chunks of 2, 1 and 3); each rank takes chunks r and 3 - r of every segment, segment after segment."""
    bounds = [0, 8, 12, 24]
    assert cp_columns(bounds, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert cp_columns(bounds, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    with pytest.raises(ValueError, match="a segment of 6 columns"):
        cp_columns([0, 8, 14], 2, 0)


def test_packed_inputs_under_cp_pad_each_rows_segment_to_2cp():
    """segment_multiple=4 (CP2): each row's real tokens start its segment, padded with token 0 to a
    multiple of 4; cu_seqlens bounds the padded segments; reading back per row is unchanged."""
    from hybridrl.training.sequences import build_model_inputs
    from tests.support.training_fixtures import rollout_batch

    batch = rollout_batch(4, seed=2)
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(-1).tolist()
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"],
            batch["response_mask"])
    pack = build_model_inputs(*args, packed=True, segment_multiple=4)
    plain = build_model_inputs(*args, packed=True)
    padded = [-(-n // 4) * 4 for n in lengths]
    assert any(p > n for p, n in zip(padded, lengths))  # the seed gives rows that need padding
    expected_ids, expected_pad = [], []
    for i, (n, width) in enumerate(zip(lengths, padded)):
        expected_ids += batch["input_ids"][i][mask[i]].tolist() + [0] * (width - n)
        expected_pad += [False] * n + [True] * (width - n)
    assert pack.input_ids[0].tolist() == expected_ids
    assert pack.cu_seqlens.tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert pack.max_seqlen == max(padded) and pack.row_starts.tolist() == pack.cu_seqlens[:-1].tolist()
    assert pack.padding_mask()[0].tolist() == expected_pad
    assert (pack.real_tokens, pack.computed_tokens) == (sum(lengths), sum(padded))
    # positions restart in every segment and run on through its padding
    assert pack.position_ids[0].tolist() == [j for width in padded for j in range(width)]
    real = batch["response_mask"].bool()
    read = [m.take(m.input_ids.unsqueeze(-1), m.predict_index).squeeze(-1)[real] for m in (pack, plain)]
    assert torch.equal(read[0], read[1])


def _attention_rank(rank: int, world: int, seq: int, batch: int) -> dict[str, Any]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu.attention import cpu_packed_attention_class
    from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES

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
    columns = cp_columns([0, seq], world, ctx.cp_rank)
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


def _packed_attention_rank(rank: int, world: int, segments: list[int]) -> dict[str, Any]:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu.attention import cpu_packed_attention_class
    from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES

    ctx = state.initialize_model_parallel(tp=1, cp=world, device="cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, context_parallel_size=world,
                               attention_dropout=0.0, hidden_dropout=0.0, **CPU_CONFIG_OVERRIDES)
    total = sum(segments)
    bounds = [0, *torch.tensor(segments).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(13)  # the whole pack, the same on every rank
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    weight = torch.randn(total, HEADS * HEAD_DIM, generator=gen)
    columns = cp_columns(bounds, world, ctx.cp_rank)
    local = [t[columns].cuda().clone().requires_grad_(True) for t in (q, k, v)]
    stand_in = cpu_packed_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")

    def params(cuts: list[int]) -> Any:
        cu = torch.tensor(cuts, dtype=torch.int32)
        longest = max(b - a for a, b in zip(cuts[:-1], cuts[1:]))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)

    out = stand_in(*local, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params(bounds))
    (out.squeeze(1) * weight[columns].cuda()).sum().backward()
    # plain torch, segment by segment over the whole pack
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch.cat([torch_causal_attention(*(t[a:b] for t in full)) for a, b in zip(bounds[:-1], bounds[1:])])
    (ref * weight).sum().backward()
    with torch.no_grad():  # the same local tokens read as one segment: the test can tell the segments apart
        as_one = stand_in(*(t.detach() for t in local), None, attn_mask_type=AttnMaskType.causal,
                          packed_seq_params=params([0, total])).squeeze(1)
    out, grads = out.squeeze(1).cpu(), [a.grad.cpu() for a in local]
    return {
        "shape": tuple(out.shape),
        "out_vs_torch": float((out - ref[columns]).abs().max()),
        "grad_vs_torch": [float((g - b.grad[columns]).abs().max()) for g, b in zip(grads, full)],
        "grad_scale": min(float(g.abs().max()) for g in grads),
        "one_segment_gap": float((as_one.cpu() - ref[columns].detach()).abs().max()),
    }


def test_cpu_attention_stand_in_packed_under_cp2_equals_plain_torch_per_segment():
    """CP2 on a pack of three segments (8, 4, 12 columns: multiples of 2 × CP), GQA: each rank's chunks
    of every segment attend to that segment's gathered keys only; output and q/k/v grads."""
    segments = [8, 4, 12]
    for r in run_ranks(_packed_attention_rank, 2, segments):
        assert r["shape"] == (sum(segments) // 2, HEADS * HEAD_DIM)
        assert r["out_vs_torch"] < 1e-6, r
        assert max(r["grad_vs_torch"]) < 1e-5 and r["grad_scale"] > 1e-2, r
        assert r["one_segment_gap"] > 1e-2, r


def test_cpu_packed_rope_under_cp2_is_megatrons_unfused_thd_rope():
    """The packed RoPE slot at CP2: each rank's tokens rotated at their global positions within their
    segment, as megatron's own unfused `_apply_rotary_pos_emb_thd` (given the CP group's size and rank)
    and as CP1's rotation of the whole pack at the rank's columns."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from hybridrl.parallel.cpu.attention import fused_rope_thd

    class Group:  # what megatron's function reads of the CP group
        def __init__(self, size: int, rank: int) -> None:
            self.size, self.rank = (lambda: size), (lambda: rank)

    bounds = [0, 8, 12, 24]
    cu = torch.tensor(bounds, dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(24, 2, 8, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6))  # rotary dim 6 of head dim 8
    angles = torch.outer(torch.arange(12).float(), inv)
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # [max segment, 1, 1, rot_dim]
    whole = fused_rope_thd(t, cu, freqs)
    for rank in (0, 1):
        columns = cp_columns(bounds, 2, rank)
        mine = fused_rope_thd(t[columns], cu, freqs, cp_size=2, cp_rank=rank)
        megatrons = _apply_rotary_pos_emb_thd(t[columns], cu, freqs, cp_group=Group(2, rank))
        assert (mine - megatrons).abs().max() < 1e-6
        assert (mine - whole[columns]).abs().max() < 1e-6
        assert (mine - t[columns]).abs().max() > 1e-1  # it rotates
    with pytest.raises(ValueError, match="on each of 2 CP ranks"):
        fused_rope_thd(t[:10], cu, freqs, cp_size=2, cp_rank=0)


# ---- the training backend: CP2 = CP1 = transformers --------------------------------------------------
TOL = 1e-5


# The runs each test compares: the reference is padded CP1; CP2 runs padded and packed.
RUNS = ((1, False), (2, False), (2, True))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_cp2_log_probs_and_entropy_equal_cp1_and_transformers(tmp_path, tp, pp):
    """Rows 0-3 hold a full row (13 columns): padded at CP2 the micro-batch is 16 = 4 chunks of 4; packed,
    each row's segment is padded to a multiple of 4. With TP2 (vocab-parallel log-probs) and PP2 (the
    last stage gathers, activations go on local)."""
    from tests.support.training_fixtures import hf_response_log_probs, job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=9)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    lengths = batch["attention_mask"].sum(-1)[:4].tolist()
    width = {(1, False): 13, (2, False): 16, (2, True): sum(-(-n // 4) * 4 for n in lengths)}
    assert width[2, True] > sum(lengths)  # some row's segment is padded
    runs = {}
    for cp, packed in RUNS:
        world = tp * pp * cp
        config = with_cp(job_config(hf, world=world, tp=tp, pp=pp, micro=4), cp, packed)
        results = run_ranks(log_prob_rank, world, config, batch)
        assert sorted(r["cp"] for r in results) == sorted((cp, r % cp) for r in range(world))
        assert all(r["width"] == width[cp, packed] and r["packed"] == packed for r in results)
        outs = [r["out"] for r in results if r["out"] is not None]
        assert len(outs) == 1  # CP rank 0 answers
        runs[cp, packed] = outs[0]
    for run in ((2, False), (2, True)):
        for key, ref in (("old_log_probs", ref_lp), ("entropys", ref_ent)):
            assert (runs[run][key] - runs[1, False][key]).abs().max() <= TOL, (run, key)
            assert (runs[run][key] - ref).abs().max() <= TOL, (run, key)
            assert runs[run][key].abs().max() > 1e-2


def test_cp2_yarn_log_probs_equal_transformers(tmp_path):
    """A YaRN policy (factor 4 over 4 original positions) at CP2, padded and packed: megatron's YaRN table cut to
    the rank's chunks (padded) or rotated per segment chunk (packed) gives transformers' log-probs and entropies."""
    from tests.support.models_fixtures import make_hf_model
    from tests.support.training_fixtures import hf_response_log_probs, job_config, rollout_batch

    hf = make_hf_model(tmp_path / "hf", "llama", rope_theta=None, max_position_embeddings=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4})
    batch = rollout_batch(8, seed=9)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    for packed in (False, True):
        config = with_cp(job_config(hf, world=2, micro=4), 2, packed)
        results = run_ranks(log_prob_rank, 2, config, batch)
        (out,) = [r["out"] for r in results if r["out"] is not None]
        for key, ref in (("old_log_probs", ref_lp), ("entropys", ref_ent)):
            assert (out[key] - ref).abs().max() <= TOL, (packed, key)


@pytest.mark.parametrize("dp,runs", [(1, RUNS), (2, RUNS[:2])])
def test_cp2_update_equals_cp1(tmp_path, dp, runs):
    """One PPO step (KL loss, entropy bonus) at CP2, padded and packed (and DP2 × CP2 padded): loss,
    grad norm and every weight of every rank equal padded CP1's at the same DP."""
    from tests.support.training_fixtures import job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=10)
    out = {}
    for cp, packed in runs:
        config = with_cp(job_config(hf, world=dp * cp, micro=2, use_kl_loss=True, entropy_coeff=0.01), cp, packed)
        results = run_ranks(weights_update_rank, dp * cp, config, batch)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == dp  # CP rank 0 of each DP rank answers
        out[cp, packed] = (metrics[0], [r["weights"] for r in results])
        before = results[0]["before"]
    m1, w1 = out[1, False]
    assert m1.grad_norm > 1e-2
    moved = max(float((w1[0][n] - p).abs().max()) for n, p in before.items())
    assert moved > 1e-3  # the step moved the weights: equal weights are a finding
    for run in runs[1:]:
        m2, w2 = out[run]
        for name in ("pg_loss", "grad_norm", "kl_loss", "entropy", "approx_kl", "clipfrac"):
            assert abs(getattr(m2, name) - getattr(m1, name)) <= TOL, (run, name)
        for weights in w2:  # every CP and DP rank holds CP1's updated weights
            for name, value in w1[0].items():
                assert (weights[name] - value).abs().max() <= TOL, (run, name)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_cp2_update_with_tp2_or_pp2_equals_cp1(tmp_path, tp, pp):
    """TP2 × CP2 and PP2 × CP2 (4 ranks), padded and packed, against padded CP1 on the same TP/PP: loss,
    grad norm, each shard's weights."""
    from tests.support.training_fixtures import job_config, policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=12)
    out = {}
    for cp, packed in RUNS:
        world = tp * pp * cp
        config = with_cp(job_config(hf, world=world, tp=tp, pp=pp, micro=2, use_kl_loss=True), cp, packed)
        results = run_ranks(weights_update_rank, world, config, batch)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == 1
        out[cp, packed] = (metrics[0], [(r["coords"], r["weights"]) for r in results])
    m1, w1 = out[1, False]
    assert m1.grad_norm > 1e-2
    cp1 = dict(w1)
    for run in RUNS[1:]:
        m2, w2 = out[run]
        for name in ("pg_loss", "grad_norm", "kl_loss", "entropy"):
            assert abs(getattr(m2, name) - getattr(m1, name)) <= TOL, (run, name)
        assert sorted(cp1) == sorted({c for c, _ in w2})
        for coords, weights in w2:
            for name, value in cp1[coords].items():
                assert (weights[name] - value).abs().max() <= TOL, (run, coords, name)


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
    """Critic values and one value update at CP2, padded and packed, against padded CP1."""
    from tests.support.training_fixtures import (
        job_config,
        policy_model,
        rollout_batch,
        sequence_classifier,
        with_critic,
    )

    hf = policy_model(tmp_path / "hf")
    critic = sequence_classifier(tmp_path / "critic")
    batch = rollout_batch(8, seed=3)
    out = {}
    for cp, packed in RUNS:
        config = with_cp(with_critic(job_config(hf, world=cp, micro=4), critic), cp, packed)
        results = [r for r in run_ranks(_critic_rank, cp, config, batch) if r["values"] is not None]
        assert len(results) == 1
        out[cp, packed] = results[0]
    base = out[1, False]
    assert base["values"].abs().max() > 1e-2
    for run in RUNS[1:]:
        assert (out[run]["values"] - base["values"]).abs().max() <= TOL, run
        for name in ("vf_loss", "grad_norm", "vpred_mean"):
            assert abs(getattr(out[run]["metrics"], name) - getattr(base["metrics"], name)) <= TOL, (run, name)


# ---- checkpoints resume across CP sizes ---------------------------------------------------------------
def test_cp2_checkpoint_resumes_on_cp1_and_back(tmp_path):
    """An actor step at CP2 (distributed optimizer: Adam state sharded over DP × CP) saved, resumed at
    CP1 and at CP2: the next step (loss, grad norm, lr, every weight) is the same; a CP1 checkpoint
    resumed at CP2 gives it too. The optimizer state and the weights are CP-invariant."""
    from tests.support.checkpoint_resumes import assert_same_next_step, checkpoint_rank, resume_config, run_resume
    from tests.support.training_fixtures import policy_model, rollout_batch

    hf = policy_model(tmp_path / "hf")
    batches = [rollout_batch(8, seed=5), rollout_batch(8, seed=6)]

    def config(cp: int) -> Any:
        return with_cp(resume_config(hf, tp=1, pp=1, dp=cp, distributed=True), cp)  # world = cp: DP 1

    ckpt2, ckpt1 = tmp_path / "cp2", tmp_path / "cp1"
    run_ranks(checkpoint_rank, 2, config(2), batches, str(ckpt2), "", "save")
    run_ranks(checkpoint_rank, 1, config(1), batches, str(ckpt1), "", "save")
    reference = run_resume(config(2), 2, batches, ckpt2, tmp_path / "ref", "resume")
    assert reference["resharded"] is False
    on_cp1 = run_resume(config(1), 1, batches, ckpt2, tmp_path / "on_cp1", "resume")
    assert on_cp1["resharded"] is True
    assert_same_next_step(on_cp1, reference, "cp2 -> cp1")
    from_cp1 = run_resume(config(2), 2, batches, ckpt1, tmp_path / "from_cp1", "resume")
    assert_same_next_step(from_cp1, reference, "cp1 -> cp2")


def test_cp2_reward_model_scores_equal_transformers(tmp_path):
    """The reward model at CP2 (packed: the default on CPU) reads each row's last real column from the
    gathered sequence."""
    from tests.support.training_fixtures import job_config, with_reward_model
    from tests.support.value_models import reward_model_case, reward_rank

    rm, hf, batch, expected = reward_model_case(tmp_path)
    config = with_reward_model(job_config(hf, world=2), rm)
    config.reward_model.megatron.context_parallel_size = 2
    scores = [s for s in run_ranks(reward_rank, 2, config, batch) if s is not None]
    assert len(scores) == 1
    assert (scores[0] - expected).abs().max() < TOL and expected.abs().max() > 1e-2
