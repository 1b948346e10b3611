"""Sequence packing (`model.use_remove_padding`): THD micro-batches, the CPU attention stand-in, and
every pass (log-probs, the PPO update, critic values and update, reward scores) against the padded
path and against references computed here (plain torch attention, transformers' per-row outputs).

The batches are ragged on purpose (`rollout_batch`: prompt lengths 1-7, response lengths 1-6, one
full row), and the micro-batches hold several rows each, so a pack has several segments and a
segment that leaked attention into its neighbour would change its log-probs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.parallel.device_policy import WITHOUT_TE
from hybridrl.training.sequences import build_model_inputs
from tests.support.forked import run_ranks
from tests.support.references import torch_causal_attention
from tests.support.training_fixtures import (
    hf_response_log_probs,
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    with_critic,
    with_reward_model,
)

TOL = 1e-5


def packed(config: Any, on: bool = True) -> Any:
    config.actor_rollout_ref.model.use_remove_padding = on
    config.critic.model.use_remove_padding = on
    config.reward_model.model.use_remove_padding = on
    return config


# ---- the packed micro-batch itself (no megatron) -----------------------------------------------------
def test_packed_inputs_hold_each_rows_real_tokens_back_to_back():
    batch = rollout_batch(8, seed=2)
    mask = batch["attention_mask"].bool()
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"],
            batch["response_mask"])
    pad = build_model_inputs(*args)
    pack = build_model_inputs(*args, packed=True)
    lengths = mask.sum(-1)
    # reference: each row's tokens where attention_mask is 1, concatenated in row order
    expected = torch.cat([batch["input_ids"][i][mask[i]] for i in range(8)])
    assert pack.is_packed and not pad.is_packed
    assert pack.input_ids.shape == (1, int(lengths.sum()))
    assert torch.equal(pack.input_ids[0], expected)
    assert pack.cu_seqlens.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert pack.cu_seqlens.dtype == torch.int32 and pack.max_seqlen == int(lengths.max())
    # positions restart at 0 in every row (the rollout's own position ids of the real tokens)
    assert torch.equal(pack.position_ids[0], torch.cat([torch.arange(int(n)) for n in lengths]))
    assert pack.real_tokens == pack.computed_tokens == int(lengths.sum())
    assert pad.computed_tokens == 8 * int(lengths.max()) and pad.real_tokens == int(lengths.sum())
    # Reading the model's output at the predicting columns gives the same numbers in both layouts:
    # an "output" equal to the input ids shows which token each layout reads.
    real = batch["response_mask"].bool()
    from_pad = pad.take(pad.input_ids.unsqueeze(-1), pad.predict_index).squeeze(-1)
    from_pack = pack.take(pack.input_ids.unsqueeze(-1), pack.predict_index).squeeze(-1)
    assert torch.equal(from_pad[real], from_pack[real])
    # the token predicting response token j is the one before it: the prompt's last, then the response
    width = batch["input_ids"].shape[1]
    prev = batch["input_ids"][:, width - batch["responses"].shape[1] - 1: width - 1]
    assert torch.equal(from_pack[real], prev[real])
    rows, cols = pack.response_token_positions()
    b, s = pack.token_index(rows, pack.predict_index[rows, cols])
    assert torch.equal(pack.input_ids[b, s], prev[rows, cols])
    assert torch.equal(pack.take(pack.input_ids.unsqueeze(-1), pack.last_index.unsqueeze(1)).flatten(),
                       torch.stack([batch["input_ids"][i][mask[i]][-1] for i in range(8)]))


def test_packed_inputs_pad_the_pack_with_a_segment_of_its_own():
    batch = rollout_batch(3, seed=5)
    lengths = batch["attention_mask"].sum(-1)
    total = int(lengths.sum())
    pack = build_model_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                              batch["responses"], batch["response_mask"], packed=True, pad_multiple=8)
    padded_total = -(-total // 8) * 8
    assert padded_total > total  # the seed gives a total that is not a multiple of 8
    assert pack.input_ids.shape == (1, padded_total)
    assert pack.cu_seqlens.tolist() == [0, *torch.cumsum(lengths, 0).tolist(), padded_total]
    assert pack.row_starts.tolist() == [0, *torch.cumsum(lengths, 0)[:-1].tolist()]
    assert (pack.real_tokens, pack.computed_tokens) == (total, padded_total)


# ---- the CPU stand-in for core attention -------------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # GQA: two query heads per key/value head


def _attention_rank(rank: int, world: int, lengths: list[int]) -> dict[str, Any]:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu.attention import cpu_packed_attention_class
    from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES
    from hybridrl.parallel.device import rank_device

    ctx = state.initialize_model_parallel(tp=world, device="cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, tensor_model_parallel_size=world,
                               attention_dropout=0.0, hidden_dropout=0.0, **CPU_CONFIG_OVERRIDES)
    heads, kv_heads = HEADS // world, KV_HEADS // world
    total = sum(lengths)
    gen = torch.Generator().manual_seed(7 + ctx.tp_rank)
    # drawn on the host, used where megatron's activations live (the rank's device under strict-device mode)
    device = rank_device("cpu")
    q, k, v = (torch.randn(total, n, HEAD_DIM, generator=gen).to(device).requires_grad_(True)
               for n in (heads, kv_heads, kv_heads))
    weight = torch.randn(total, heads * HEAD_DIM, generator=gen).to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    stand_in = cpu_packed_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
    out = stand_in(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    (out.squeeze(1) * weight).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]

    # plain torch, row by row
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    bounds = cu.tolist()
    ref = torch.cat([torch_causal_attention(ref_q[a:b], ref_k[a:b], ref_v[a:b])
                     for a, b in zip(bounds[:-1], bounds[1:])])
    (ref * weight).sum().backward()

    # megatron's own (padded) path: rows right-padded to the longest, [s, b, heads, d]
    longest = max(lengths)
    def padded(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(longest, len(lengths), *t.shape[1:])
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            out[: b - a, i] = t[a:b]
        return out
    plain = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    with torch.no_grad():
        from_padded = plain(padded(q), padded(k), padded(v), None, attn_mask_type=AttnMaskType.causal)
        unpadded = torch.cat([from_padded[: b - a, i] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
        # the same pack read as one sequence (no cu_seqlens): rows would see their predecessors
        as_one = stand_in(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None,
                          attn_mask_type=AttnMaskType.causal).squeeze(1)
    refused = None
    try:
        plain(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    except AssertionError as err:
        refused = str(err)
    return {
        "out_vs_torch": float((out.squeeze(1) - ref).abs().max()),
        "out_vs_padded": float((out.squeeze(1).detach() - unpadded).abs().max()),
        "grad_vs_torch": max(float((g - r.grad).abs().max()) for g, r in zip(grads, (ref_q, ref_k, ref_v))),
        "grad_scale": min(float(g.abs().max()) for g in grads),
        "one_sequence_gap": float((as_one - ref.detach()).abs().max()),
        "shape": tuple(out.shape),
        "megatron_refuses": refused,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_packed_attention_equals_plain_torch_per_row(world):
    """The stand-in at TP1 (4 query heads, 2 KV heads) and TP2 (per rank 2 and 1): GQA either way."""
    lengths = [5, 1, 9, 3]
    for r in run_ranks(_attention_rank, world, lengths):
        assert r["shape"] == (sum(lengths), 1, HEADS // world * HEAD_DIM)
        assert r["out_vs_torch"] < 1e-6 and r["out_vs_padded"] < 1e-6
        assert r["grad_vs_torch"] < 1e-5 and r["grad_scale"] > 1e-2
        assert r["one_sequence_gap"] > 1e-2  # without the segments the rows would mix: the test can tell
        assert r["megatron_refuses"] is not None and "Packed sequence is not supported" in r["megatron_refuses"]


def test_cpu_packed_rope_rotates_each_segment_from_position_zero():
    from hybridrl.parallel.cpu.attention import fused_rope_thd

    lengths = [4, 1, 6]
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(sum(lengths), 2, 8, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6))  # rotary dim 6 of head dim 8: 2 pass through
    angles = torch.outer(torch.arange(max(lengths)).float(), inv)
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # megatron's [s, 1, 1, rot_dim]
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    out = fused_rope_thd(t, cu, freqs)
    # reference: rotate-half RoPE of each segment alone, positions 0..len-1
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        x, rest = t[a:b, :, :6], t[a:b, :, 6:]
        cos, sin = freqs[: b - a, 0].cos(), freqs[: b - a, 0].sin()
        rotated = torch.cat([-x[..., 3:], x[..., :3]], -1)
        parts.append(torch.cat([x * cos + rotated * sin, rest], -1))
    assert (out - torch.cat(parts)).abs().max() < 1e-6
    with pytest.raises(ValueError, match="cu_seqlens ends at 10"):
        fused_rope_thd(t, torch.tensor([0, 4, 10], dtype=torch.int32), freqs)


# ---- the training backend: packed = padded = transformers --------------------------------------------
def _log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    out = actor.compute_log_prob(batch, with_entropy=True)
    micros = backend.micro_batches(batch.tensors, [[0, 1, 2, 3]])
    layout = (tuple(micros[0].input_ids.shape), micros[0].is_packed)
    return {"out": None if out is None else {k: v.clone() for k, v in out.tensors.items()},
            "layout": layout, "padding_ratio": backend.tokens_seen.padding_ratio()}


LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp)


def _pass_batching_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    cuts = []
    partition = backend.partition

    def recorded(tensors, micro_batch_size, **options):  # the real partition, its arguments and result kept
        parts = partition(tensors, micro_batch_size, **options)
        cuts.append((options.get("dynamic"), options.get("max_tokens"), [len(p) for p in parts]))
        return parts

    backend.partition = recorded
    out = MegatronActor(backend, plan).compute_log_prob(batch)
    return {"out": None if out is None else out.tensors["old_log_probs"].clone(), "cuts": cuts}


def test_the_log_prob_pass_has_its_own_token_budget(tmp_path):
    """verl's rollout.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu: the old-log-prob pass cuts its
    micro-batches by its own token budget while the actor's update keeps fixed ones; the log-probs are
    transformers' either way."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=9)
    ref_lp, _ = hf_response_log_probs(hf, batch)
    config = job_config(hf, world=1, micro=4)
    config.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz = True
    config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu = 20
    (result,) = run_ranks(_pass_batching_rank, 1, config, batch)
    ((dynamic, budget, sizes),) = result["cuts"]
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert (dynamic, budget, sum(sizes)) == (True, 20, 8) and len(sizes) >= -(-sum(lengths) // 20) > 2
    assert (result["out"] - ref_lp).abs().max() <= TOL
    assert config.actor_rollout_ref.actor.use_dynamic_bsz is False  # the update's batching is its own


def test_packed_log_probs_equal_padded_and_transformers(tmp_path):
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=9)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    real = int(batch["attention_mask"].sum(-1)[:4].sum())
    for tp, pp in LAYOUTS:
        runs = {}
        for on in (False, True):
            config = packed(job_config(hf, world=tp * pp, tp=tp, pp=pp, micro=4), on)
            results = run_ranks(_log_prob_rank, tp * pp, config, batch)
            assert all(r["layout"][1] == on for r in results)
            if on:  # four rows as one sequence of their real tokens
                assert all(r["layout"][0] == (1, real) for r in results)
                assert all(r["padding_ratio"] == 0.0 for r in results)
            else:
                assert all(r["padding_ratio"] > 0.1 for r in results)
            runs[on] = [r["out"] for r in results if r["out"] is not None][0]
        for key, ref in (("old_log_probs", ref_lp), ("entropys", ref_ent)):
            assert (runs[True][key] - runs[False][key]).abs().max() <= TOL, (tp, pp, key)
            assert (runs[True][key] - ref).abs().max() <= TOL, (tp, pp, key)


def test_yarn_log_probs_packed_and_padded_equal_transformers(tmp_path):
    """A YaRN policy (factor 4 over an original context of 4 tokens, so every position of these 13-token rows is
    past it) in the actor's log-prob pass, packed (THD: megatron's YaRN table through the CPU packed-RoPE slot) and
    padded: transformers' log-probs and entropies both ways."""
    from tests.support.models_fixtures import make_hf_model

    hf = make_hf_model(tmp_path / "hf", "llama", rope_theta=None, max_position_embeddings=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4})
    batch = rollout_batch(8, seed=9)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    for on in (False, True):
        config = packed(job_config(hf, world=1, micro=4), on)
        (result,) = run_ranks(_log_prob_rank, 1, config, batch)
        assert result["layout"][1] == on
        for key, ref in (("old_log_probs", ref_lp), ("entropys", ref_ent)):
            assert (result["out"][key] - ref).abs().max() <= TOL, (on, key)
    # the same weights with plain RoPE: other log-probs, so the check sees the YaRN setting
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(hf / "model.safetensors")
    config = json.loads((hf / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(config))
    assert (hf_response_log_probs(plain, batch)[0] - ref_lp).abs().max() > 10 * TOL


def _update_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    metrics = MegatronActor(backend, plan).update_policy(batch.split(backend.ctx.dp)[backend.ctx.dp_rank])
    weights = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(backend.chunks) for n, p in c.named_parameters()}
    return {"metrics": metrics, "weights": weights, "coords": (backend.ctx.tp_rank, backend.ctx.pp_rank)}


def test_packed_update_equals_padded(tmp_path):
    """One PPO step (KL loss, entropy bonus): loss, grad norm and every updated weight, TP1/TP2/PP2/DP2."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=10)
    # perf/padding_ratio by hand: micro-batches of rows 0-3 and 4-7, each padded to its longest row
    lengths = batch["attention_mask"].sum(-1)
    computed = sum(4 * int(lengths[i:i + 4].max()) for i in (0, 4))
    padding_ratio = 1 - int(lengths.sum()) / computed
    assert padding_ratio > 0.1
    for tp, pp, dp in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)):
        runs = {}
        for on in (False, True):
            config = packed(job_config(hf, world=tp * pp * dp, tp=tp, pp=pp, micro=4, use_kl_loss=True,
                                       entropy_coeff=0.01), on)
            results = run_ranks(_update_rank, tp * pp * dp, config, batch)
            runs[on] = ([r["metrics"] for r in results if r["metrics"] is not None][0],
                        {r["coords"]: r["weights"] for r in results})  # DP replicas: one of them
        (pad_m, pad_w), (pack_m, pack_w) = runs[False], runs[True]
        for name in ("pg_loss", "grad_norm", "kl_loss", "entropy", "approx_kl", "clipfrac"):
            assert abs(getattr(pack_m, name) - getattr(pad_m, name)) <= TOL, (tp, pp, dp, name)
        assert pad_m.grad_norm > 1e-2
        assert pad_m.padding_ratio == pytest.approx(padding_ratio, abs=1e-12) and pack_m.padding_ratio == 0.0
        assert pad_m.as_dict()["perf/padding_ratio"] == pad_m.padding_ratio
        for coord, weights in pad_w.items():
            for name, value in weights.items():
                assert (pack_w[coord][name] - value).abs().max() <= TOL, (tp, pp, dp, coord, name)


def test_packed_token_budget_micro_batches_give_the_padded_step(tmp_path):
    """use_dynamic_bsz (micro-batches cut by a token budget, agreed over DP2) packed = padded fixed micro-batches."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=4)
    (base_run,) = run_ranks(_update_rank, 1, packed(job_config(hf, world=1, micro=4), False), batch)
    base = base_run["metrics"]
    config = packed(job_config(hf, world=2, micro=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20))
    results = run_ranks(_update_rank, 2, config, batch)
    metrics = [r["metrics"] for r in results][0]
    for name in ("pg_loss", "grad_norm", "entropy", "clipfrac"):
        assert abs(getattr(metrics, name) - getattr(base, name)) <= 1e-6, name
    assert metrics.padding_ratio == 0.0 and base.padding_ratio > 0.0
    assert results[0]["weights"].keys() == results[1]["weights"].keys()
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name  # DP replicas agree
        assert (value - base_run["weights"][name]).abs().max() <= 1e-5, name


def test_packed_update_with_activation_recomputation_equals_padded(tmp_path):
    """model.enable_gradient_checkpointing: megatron's full recompute re-runs the packed forward."""
    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8, seed=12)
    runs = {}
    for on in (False, True):
        config = packed(job_config(hf, world=1, micro=4), on)
        config.actor_rollout_ref.model.enable_gradient_checkpointing = True
        (runs[on],) = run_ranks(_update_rank, 1, config, batch)
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert abs(getattr(runs[True]["metrics"], name) - getattr(runs[False]["metrics"], name)) <= TOL, name
    for name, value in runs[False]["weights"].items():
        assert (runs[True]["weights"][name] - value).abs().max() <= TOL, name


def test_packed_critic_and_reward_model_equal_torch_and_transformers(tmp_path):
    """Values, the value update (plain torch reference) and reward scores (transformers) when packed."""
    import transformers

    from tests.support.value_models import critic_rank, reference_critic, reward_rank

    rm = sequence_classifier(tmp_path / "rm")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8)
    ref = reference_critic(rm, batch)
    for tp, pp in ((1, 1), (1, 2)):
        config = packed(with_critic(job_config(hf, world=tp * pp, micro=4), rm, tp=tp, pp=pp))
        out = [o for o in run_ranks(critic_rank, tp * pp, config, batch) if o is not None][0]
        assert (out["before"] - ref["before"]).abs().max() < TOL, (tp, pp)
        assert abs(out["metrics"].vf_loss - ref["loss"]) < TOL
        assert abs(out["metrics"].grad_norm - ref["grad_norm"]) < TOL
        assert (out["after"] - ref["after"]).abs().max() < TOL, (tp, pp)
    model = transformers.LlamaForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                        attn_implementation="eager")
    scores_batch = rollout_batch(8, seed=3)
    with torch.no_grad():
        expected = model(input_ids=scores_batch["input_ids"], attention_mask=scores_batch["attention_mask"],
                         position_ids=scores_batch["position_ids"]).logits.squeeze(-1)
    config = packed(with_reward_model(job_config(hf, world=2), rm, tp=2))
    scores = [s for s in run_ranks(reward_rank, 2, config, scores_batch) if s is not None][0]
    assert (scores - expected).abs().max() < TOL


def test_packed_actor_objective_equals_the_transformers_reference(tmp_path):
    """The full PPO objective (temperature, clip bounds, dual clip, entropy, KL) and every gradient,
    recomputed from transformers row by row (tests/training/test_actor_reference.py), packed at TP2 x PP2."""
    from tests.support.actor_reference import (
        CASES,
        POLICY,
        actor_config,
        actor_step_rank,
        assert_matches_reference,
        ppo_batch,
        reference_step,
    )
    from tests.support.models_fixtures import safetensors_state
    from tests.support.rollout_models import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", POLICY)
    batch = ppo_batch(hf)
    cases = (CASES[0], CASES[3])  # token-mean + k3, seq-mean-token-mean + k1
    configs = [packed(actor_config(hf, case, tp=2, pp=2, rows=len(batch))) for case in cases]
    out_dirs = [str(tmp_path / f"grads_{i}") for i in range(len(cases))]
    results = run_ranks(actor_step_rank, 4, configs, batch, out_dirs)
    for i, case in enumerate(cases):
        metrics = [r[i] for r in results if r[i] is not None][0]
        expected = reference_step(hf, batch, case)
        assert_matches_reference(expected, metrics, safetensors_state(tmp_path / f"grads_{i}"), f"packed {case}")


# ---- config ------------------------------------------------------------------------------------------
def test_use_remove_padding_is_a_checked_model_field():
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.loader import load_config

    config = load_config(None, ["actor_rollout_ref.model.use_remove_padding=true",
                                "critic.model.use_remove_padding=false"])
    assert config.actor_rollout_ref.model.use_remove_padding is True
    assert config.critic.model.use_remove_padding is False
    assert config.reward_model.model.use_remove_padding is None  # unset: resolved by the plan
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.use_remove_padding") as err:
        load_config(None, ["actor_rollout_ref.model.use_remove_padding=sometimes"])
    assert "sometimes" in str(err.value)


@pytest.mark.parametrize("device,served", [("cpu", "the CPU layer's attention stand-in"),
                                           ("cuda", "TransformerEngine's attention")])
def test_use_remove_padding_defaults_on_where_the_device_serves_packed_attention(device, served):
    """Unset, every role packs (cpu: the stand-in; cuda: TE, which the gpu extra installs); a user's
    false is kept; `hybridrl plan` says which roles pack, whether by default, and what serves it."""
    from hybridrl.config import plan_from_sources
    from hybridrl.config.report import render_plan
    from hybridrl.training.backend import role_spec

    seed_job = Path(__file__).resolve().parents[2] / "configs/examples/seed_6gpu_grpo.yaml"

    base = [f"trainer.device={device}", "algorithm.adv_estimator=gae", "reward_model.enable=true",
            "reward_model.model.path=" + str(seed_job.parents[2] / "configs/models/tiny-demo")]
    plan = plan_from_sources(seed_job, base)
    assert all(plan.resolved.packed(role) for role in ("actor", "ref", "critic", "reward_model"))
    assert plan.config.actor_rollout_ref.model.use_remove_padding is None  # the user's config is not rewritten
    assert role_spec(plan, "actor").packed and role_spec(plan, "critic").packed
    line = [w for w in render_plan(plan).splitlines() if w.startswith("Sequence packing:")]
    # cpu: the stand-in also holds a shared prompt once (model.shared_prefix, tests/training/test_shared_prefix.py)
    shared = (lambda section: f" with shared prompts ({section}.shared_prefix default on cpu)" if device == "cpu"
              else "")
    assert line == [f"Sequence packing: actor/ref packed (actor_rollout_ref.model.use_remove_padding default on "
                    f"{device}){shared('actor_rollout_ref.model')}, critic packed (critic.model.use_remove_padding "
                    f"default on {device}){shared('critic.model')}, reward_model packed "
                    f"(reward_model.model.use_remove_padding default on {device}){shared('reward_model.model')}; "
                    f"packed attention: {served}" + (f" (the gpu extra installs it; {WITHOUT_TE})"
                                                     if device == "cuda" else "")]
    off = plan_from_sources(seed_job, [*base, "critic.model.use_remove_padding=false"])
    assert not off.resolved.packed("critic") and off.resolved.packed("actor")
    assert not role_spec(off, "critic").packed
    assert "critic padded (critic.model.use_remove_padding set)" in render_plan(off)
