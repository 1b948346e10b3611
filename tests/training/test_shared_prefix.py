"""Shared prompts (`model.shared_prefix`): rows of a packed micro-batch with the same prompt hold it once,
`[prompt, response_1, ..., response_k]`, each response attending to the prompt and causally to itself.

Checked against references computed here: the pack's layout by hand from the batch, the CPU stand-in's
attention and RoPE against plain torch per row (the prompt's leaf tensors shared by the rows, so autograd
sums their gradients as the stand-in must), and the actor's passes against transformers row by row and
against the unshared packed path (log-probs, entropy, the reference pass, one PPO update's loss, grad norm,
every weight and, at two layouts, every gradient of the whole objective).

The batches (`GROUPS`) hold prompts sampled 3, 3, 1 and 1 times, cut into micro-batches of 4 rows: one
micro-batch shares a prompt among three rows and holds another's first row alone, the next shares that
prompt between its other two rows and holds two lone rows, so groups, split groups and lone rows all occur.
One row's response mask has a hole (a multi-turn observation token): sharing does not depend on it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.training.sequences import build_model_inputs
from tests.support.forked import run_ranks
from tests.support.references import torch_causal_attention
from tests.support.training_fixtures import PROMPT, hf_response_log_probs, job_config, policy_model, rollout_batch

TOL = 1e-5
GROUPS = [3, 3, 1, 1]


def grouped_batch(seed: int = 3) -> Any:
    batch = rollout_batch(sum(GROUPS), seed=seed, groups=GROUPS)
    mask = batch["response_mask"].clone()
    row = next(i for i in range(len(batch)) if int(mask[i].sum()) >= 3)
    mask[row, 1] = 0  # an observation token inside the response: read, never trained on
    batch["response_mask"] = mask
    batch["advantages"] = batch["advantages"] * mask
    return batch


def model_args(batch: Any, rows: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    index = torch.tensor(rows if rows is not None else list(range(len(batch))))
    return tuple(batch[k].index_select(0, index) for k in keys)


# ---- the pack itself (no megatron) --------------------------------------------------------------------
def test_a_shared_prompt_is_packed_once_before_its_rows_responses():
    batch = grouped_batch()
    rows = [0, 1, 2, 3]  # prompt A three times, then prompt B's first row alone
    args = model_args(batch, rows)
    shared = build_model_inputs(*args, packed=True, shared_prefix=True)
    plain = build_model_inputs(*args, packed=True)
    mask = args[1].bool()
    real = [args[0][i][mask[i]] for i in range(4)]  # each row's real tokens
    p = int(mask[0, :PROMPT].sum())
    lengths = [len(r) for r in real]
    # by hand: A's prompt, A's three responses, then row 3 whole
    expected = torch.cat([real[0][:p], real[0][p:], real[1][p:], real[2][p:], real[3]])
    assert torch.equal(shared.input_ids[0], expected)
    assert shared.cu_seqlens.tolist() == [0, p + sum(n - p for n in lengths[:3]), len(expected)]
    branches = [0] * p + [1] * (lengths[0] - p) + [2] * (lengths[1] - p) + [3] * (lengths[2] - p) + [0] * lengths[3]
    assert shared.prefix_branches.tolist() == branches
    # each token at its position in its own row: the prompt from 0, every response from the prompt's end
    positions = [*range(p), *range(p, lengths[0]), *range(p, lengths[1]), *range(p, lengths[2]), *range(lengths[3])]
    assert shared.position_ids[0].tolist() == positions
    assert (shared.real_tokens, shared.computed_tokens, shared.row_tokens) == (len(expected), len(expected),
                                                                               sum(lengths))
    assert plain.prefix_branches is None and plain.real_tokens == plain.row_tokens == sum(lengths)
    # reading the output: every response token is predicted from the same token (and position) as alone,
    # the first one from the shared prompt's last column
    resp = args[4].bool()
    for field in ("input_ids", "position_ids"):
        from_shared = shared.take(getattr(shared, field).unsqueeze(-1), shared.predict_index).squeeze(-1)
        from_plain = plain.take(getattr(plain, field).unsqueeze(-1), plain.predict_index).squeeze(-1)
        assert torch.equal(from_shared[resp], from_plain[resp])
    first = shared.packed_columns[torch.arange(3), shared.predict_index[:3, 0]]
    assert first.tolist() == [p - 1] * 3  # rows 0-2: the prompt's last column, shared
    b, s = shared.token_index(*shared.response_token_positions())
    assert torch.equal(b, torch.zeros_like(b))
    assert not shared.padding_mask().any()  # every column holds some row's token
    last = shared.take(shared.input_ids.unsqueeze(-1), shared.last_index.unsqueeze(1)).flatten()
    assert last.tolist() == [int(r[-1]) for r in real]


def test_only_equal_prompts_share_and_padding_stays_its_own_segment():
    batch = rollout_batch(6, seed=8)  # six different prompts, uid i // 2: the uid alone shares nothing
    args = model_args(batch)
    shared = build_model_inputs(*args, packed=True, shared_prefix=True, pad_multiple=8)
    plain = build_model_inputs(*args, packed=True, pad_multiple=8)
    assert shared.prefix_branches is None
    for name in ("input_ids", "position_ids", "cu_seqlens", "packed_columns"):
        assert torch.equal(getattr(shared, name), getattr(plain, name)), name
    with pytest.raises(ValueError, match="needs packed"):
        build_model_inputs(*args, shared_prefix=True)
    with pytest.raises(ValueError, match="context parallelism"):
        build_model_inputs(*args, packed=True, shared_prefix=True, segment_multiple=4)


# ---- the CPU stand-in: attention and RoPE over a shared prompt --------------------------------------
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


# a segment [prompt 4 | responses 3, 1, 5], a lone row of 6, a segment [prompt 2 | responses 2, 2]
SEGMENTS = [(4, [3, 1, 5]), (6, []), (2, [2, 2])]


def _tree_rank(rank: int, world: int) -> dict[str, Any]:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.parallel import state
    from hybridrl.parallel.cpu.attention import cpu_packed_attention_class, shared_prefix_seq_params
    from hybridrl.parallel.cpu.layer import CPU_CONFIG_OVERRIDES
    from hybridrl.parallel.device import rank_device

    ctx = state.initialize_model_parallel(tp=world, device="cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, tensor_model_parallel_size=world,
                               attention_dropout=0.0, hidden_dropout=0.0, **CPU_CONFIG_OVERRIDES)
    heads, kv_heads = HEADS // world, KV_HEADS // world
    device = rank_device("cpu")  # where megatron's activations live (tagged as the GPU's under strict-device mode)
    branches: list[int] = []
    positions: list[int] = []
    bounds = [0]
    for prompt, responses in SEGMENTS:
        branches += [0] * prompt + [b for b, n in enumerate(responses, 1) for _ in range(n)]
        positions += [*range(prompt)] + [prompt + j for n in responses for j in range(n)]
        bounds.append(bounds[-1] + prompt + sum(responses))
    total = bounds[-1]
    gen = torch.Generator().manual_seed(5 + ctx.tp_rank)
    q, k, v = (torch.randn(total, n, HEAD_DIM, generator=gen).to(device).requires_grad_(True)
               for n in (heads, kv_heads, kv_heads))
    weight = torch.randn(total, heads * HEAD_DIM, generator=gen).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    params = shared_prefix_seq_params(cu, longest, torch.tensor(positions, device=device),
                                      torch.tensor(branches, device=device))
    stand_in = cpu_packed_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
    out = stand_in(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params).squeeze(1)
    (out * weight).sum().backward()

    # plain torch, row by row: each response after its prompt, the prompt's leaves shared by the rows
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    loss = torch.zeros((), device=device)
    expected = torch.zeros_like(out)
    for (prompt, responses), start in zip(SEGMENTS, bounds[:-1]):
        head = list(range(start, start + prompt))
        offset = start + prompt
        for n in responses or [0]:
            cols = head + list(range(offset, offset + n))
            row = torch_causal_attention(ref_q[cols], ref_k[cols], ref_v[cols])
            loss = loss + (row[prompt:] * weight[cols[prompt:]]).sum()  # each response token once
            expected[cols[prompt:]] = row[prompt:].detach()
            offset += n
        # the prompt's own outputs (the same in every row: it attends to itself only)
        row = torch_causal_attention(ref_q[head], ref_k[head], ref_v[head])
        loss = loss + (row * weight[head]).sum()
        expected[head] = row.detach()
    loss.backward()
    with torch.no_grad():  # the same tensors without the tree: the responses would see one another
        plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                max_seqlen_kv=longest)
        untreed = stand_in(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=plain).squeeze(1)
    grads = [t.grad for t in (q, k, v)]
    return {
        "out_gap": float((out.detach() - expected).abs().max()),
        "grad_gap": max(float((g - r.grad).abs().max()) for g, r in zip(grads, (ref_q, ref_k, ref_v))),
        "grad_scale": min(float(g.abs().max()) for g in grads),
        "without_tree_gap": float((untreed - expected).abs().max()),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_stand_in_attends_each_response_to_its_prompt_and_itself(world):
    for r in run_ranks(_tree_rank, world):
        assert r["out_gap"] < 1e-6 and r["grad_gap"] < 1e-5 and r["grad_scale"] > 1e-2, r
        assert r["without_tree_gap"] > 1e-2  # the test can tell a tree from a causal run


def test_cpu_packed_rope_rotates_a_shared_pack_by_each_rows_positions():
    from hybridrl.parallel.cpu.attention import fused_rope_thd, shared_prefix_seq_params

    positions = [0, 1, 2, 3, 4, 3, 4, 5, 0, 1]  # prompt 0-2, responses at 3-4 and 3-5, then a lone row
    branches = [0, 0, 0, 1, 1, 2, 2, 2, 0, 0]
    cu = torch.tensor([0, 8, 10], dtype=torch.int32)
    params = shared_prefix_seq_params(cu, 8, torch.tensor(positions), torch.tensor(branches))
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(10, 2, 8, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6))
    angles = torch.outer(torch.arange(8).float(), inv)
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]
    out = fused_rope_thd(t, params.cu_seqlens_q, freqs)
    x, rest = t[..., :6], t[..., 6:]
    cos, sin = freqs[positions, 0].cos(), freqs[positions, 0].sin()
    expected = torch.cat([x * cos + torch.cat([-x[..., 3:], x[..., :3]], -1) * sin, rest], -1)
    assert (out - expected).abs().max() < 1e-6
    plain = fused_rope_thd(t, cu, freqs)  # the same pack read as segments: responses restart at 0
    assert (plain - expected).abs().max() > 1e-2
    with pytest.raises(ValueError, match="past max_seqlen"):
        shared_prefix_seq_params(cu, 5, torch.tensor(positions), torch.tensor(branches))


# ---- the actor: old log-probs, the reference pass and one update, shared = unshared = transformers -----
def _passes_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    out: dict[str, Any] = {}
    for shared in (False, True):
        actor = MegatronBackend(dataclasses.replace(role_spec(plan, "actor"), shared_prefix=shared))
        ref = MegatronBackend(dataclasses.replace(role_spec(plan, "ref"), shared_prefix=shared))
        ctx = actor.ctx
        mine = batch.split(ctx.dp)[ctx.dp_rank]
        old = MegatronActor(actor, plan).compute_log_prob(mine, with_entropy=True)
        ref_out = MegatronActor(ref, plan, log_prob_pass="ref_log_prob",
                               output_key="ref_log_probs").compute_log_prob(mine)
        metrics = MegatronActor(actor, plan).update_policy(mine)
        weights = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(actor.chunks) for n, p in c.named_parameters()}
        out[shared] = {
            "old": None if old is None else {k: v.clone() for k, v in old.tensors.items()},
            "old_meta": None if old is None else dict(old.meta),
            "ref": None if ref_out is None else ref_out["ref_log_probs"].clone(),
            "metrics": metrics, "weights": weights, "coords": (ctx.tp_rank, ctx.pp_rank), "dp_rank": ctx.dp_rank,
        }
    return out


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_shared_prompts_give_the_unshared_passes_and_transformers(tmp_path, tp, pp, dp):
    hf = policy_model(tmp_path / "hf")
    batch = grouped_batch()
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    config = job_config(hf, world=tp * pp * dp, tp=tp, pp=pp, micro=4 // dp, use_kl_loss=True, entropy_coeff=0.01)
    config.actor_rollout_ref.model.use_remove_padding = True
    results = run_ranks(_passes_rank, tp * pp * dp, config, batch)
    outputs = {}
    for shared in (False, True):
        per_dp = sorted((r[shared] for r in results if r[shared]["old"] is not None), key=lambda o: o["dp_rank"])
        outputs[shared] = {
            "old_log_probs": torch.cat([o["old"]["old_log_probs"] for o in per_dp]),
            "entropys": torch.cat([o["old"]["entropys"] for o in per_dp]),
            "ref_log_probs": torch.cat([o["ref"] for o in per_dp]),
            "metrics": per_dp[0]["metrics"],
            "ratio": per_dp[0]["old_meta"]["shared_prefix_ratio"],
            "weights": {r[shared]["coords"]: r[shared]["weights"] for r in results},
        }
    on, off = outputs[True], outputs[False]
    for key, hf_value in (("old_log_probs", ref_lp), ("entropys", ref_ent), ("ref_log_probs", ref_lp)):
        assert (on[key] - off[key]).abs().max() <= TOL, key
        assert (on[key] - hf_value).abs().max() <= TOL, key
    for name in ("pg_loss", "grad_norm", "kl_loss", "entropy", "approx_kl", "clipfrac"):
        assert abs(getattr(on["metrics"], name) - getattr(off["metrics"], name)) <= TOL, name
    assert off["metrics"].grad_norm > 1e-2
    for coord, weights in off["weights"].items():
        for name, value in weights.items():
            assert (on["weights"][coord][name] - value).abs().max() <= TOL, (coord, name)
    # the prompts were shared: of each micro-batch of 4 rows (dp 1) or 2 rows (dp 2), the shared ones
    mask = batch["attention_mask"].bool()
    prompt = mask[:, :PROMPT].sum(-1).tolist()
    rows = mask.sum(-1).tolist()
    micro = 4 // dp
    saved = sum(prompt[r] for start in range(0, len(rows), micro)
                for r in range(start + 1, start + micro) if GROUP_OF[r] == GROUP_OF[r - 1])
    assert on["ratio"] == pytest.approx(saved / sum(rows), abs=1e-12) and saved > 0
    assert on["metrics"].shared_prefix_ratio == on["ratio"] and off["ratio"] == 0.0
    assert on["metrics"].padding_ratio == 0.0


GROUP_OF = [g for g, size in enumerate(GROUPS) for _ in range(size)]


def _shuffled_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    out: dict[str, Any] = {}
    for shared in (False, True):
        backend = MegatronBackend(dataclasses.replace(role_spec(plan, "actor"), shared_prefix=shared))
        actor = MegatronActor(backend, plan)
        out[shared] = {"order": actor._row_order(batch, 1), "metrics": actor.update_policy(batch),
                       "weights": {n: p.detach().clone() for n, p in backend.chunks[0].named_parameters()}}
    return out


def test_shuffled_epochs_move_whole_prompt_groups(tmp_path):
    """actor.shuffle with ppo_epochs 2: with shared prompts the second epoch's order permutes whole groups;
    both epochs' updates equal the unshared row shuffle's (each epoch one mini-batch of every row)."""
    hf = policy_model(tmp_path / "hf")
    batch = grouped_batch()
    config = job_config(hf, world=1, micro=4, ppo_epochs=2, shuffle=True)
    config.actor_rollout_ref.model.use_remove_padding = True
    (out,) = run_ranks(_shuffled_rank, 1, config, batch)
    order = out[True]["order"]
    assert sorted(order) == list(range(len(batch))) and order != list(range(len(batch)))
    runs = [GROUP_OF[r] for i, r in enumerate(order) if i == 0 or GROUP_OF[r] != GROUP_OF[order[i - 1]]]
    assert sorted(runs) == list(range(len(GROUPS)))  # each group one run: its rows next to each other
    assert out[True]["metrics"].optimizer_steps == 2 and out[True]["metrics"].shared_prefix_ratio > 0
    for name in ("pg_loss", "grad_norm", "entropy"):
        assert abs(getattr(out[True]["metrics"], name) - getattr(out[False]["metrics"], name)) <= TOL, name
    for name, value in out[False]["weights"].items():
        assert (out[True]["weights"][name] - value).abs().max() <= TOL, name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_shared_prompts_update_equals_the_transformers_objective(tmp_path, tp, pp):
    """The whole PPO objective (clips, dual clip, entropy, KL) and every gradient against transformers row
    by row (tests/training/test_actor_reference.py), on grouped rows shared in their micro-batches."""
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
    batch = ppo_batch(hf, groups=GROUPS)
    case = CASES[3]  # seq-mean-token-mean + k1: a row's tokens weigh by its own length
    config = actor_config(hf, case, tp=tp, pp=pp, rows=len(batch))
    config.actor_rollout_ref.model.use_remove_padding = True
    config.actor_rollout_ref.model.shared_prefix = True
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 4
    out_dir = str(tmp_path / "grads")
    results = run_ranks(actor_step_rank, tp * pp, [config], batch, [out_dir])
    metrics = [r[0] for r in results if r[0] is not None][0]
    assert metrics.shared_prefix_ratio > 0.1
    assert_matches_reference(reference_step(hf, batch, case), metrics, safetensors_state(tmp_path / "grads"),
                             f"shared tp{tp} pp{pp}")


# ---- where it runs: the plan's default and the backend's own guards ------------------------------------
def test_shared_prefix_defaults_on_where_served(tmp_path):
    """Unset, it is on where the CPU stand-in serves packed micro-batches of a dense model at CP 1, off
    elsewhere; a user's false is kept (the refusals of true: tests/config/test_validation.py)."""
    from hybridrl.config import plan_from_sources
    from hybridrl.config.report import packing_line
    from hybridrl.training.backend import role_spec
    from tests.support.models_fixtures import moe_model_dir

    seed_job = Path(__file__).resolve().parents[2] / "configs/examples/seed_6gpu_grpo.yaml"

    roles = ("actor", "ref", "critic", "reward_model")
    cpu = plan_from_sources(seed_job, ["trainer.device=cpu"])
    assert all(cpu.resolved.shared_prefix(role) for role in roles)
    assert cpu.config.actor_rollout_ref.model.shared_prefix is None  # the user's config is not rewritten
    assert role_spec(cpu, "actor").shared_prefix and role_spec(cpu, "ref").shared_prefix
    assert "actor/ref packed (actor_rollout_ref.model.use_remove_padding default on cpu) with shared prompts " \
           "(actor_rollout_ref.model.shared_prefix default on cpu)" in packing_line(cpu)
    for off in (["trainer.device=cuda"],
                ["trainer.device=cpu", "actor_rollout_ref.model.use_remove_padding=false"],
                ["trainer.device=cpu", "actor_rollout_ref.actor.megatron.context_parallel_size=2"],
                ["trainer.device=cpu", moe_model_dir(tmp_path)],
                ["trainer.device=cpu", "actor_rollout_ref.model.shared_prefix=false"]):
        plan = plan_from_sources(seed_job, off)
        assert not plan.resolved.shared_prefix("actor") and not role_spec(plan, "ref").shared_prefix, off
        assert plan.resolved.shared_prefix("critic") == (off[0] == "trainer.device=cpu"), off
    kept = plan_from_sources(seed_job, ["trainer.device=cpu", "actor_rollout_ref.model.shared_prefix=false"])
    assert "with per-row prompts (actor_rollout_ref.model.shared_prefix set)" in packing_line(kept)


def _guard_rank(rank: int, world: int, config: Any, moe_path: str) -> list[str]:
    from hybridrl.config.plan import build_plan
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    spec = role_spec(plan, "actor")
    errors = []
    for bad in (dataclasses.replace(spec, packed=False, shared_prefix=True),
                dataclasses.replace(spec, role="reward_model", model_path=moe_path, optim=None, shared_prefix=True)):
        try:
            MegatronBackend(bad)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_the_backend_refuses_what_it_cannot_share(tmp_path):
    """Behind the plan: unpacked micro-batches, and a mixture-of-experts model in a role whose shape the
    plan does not read (its router would count a shared prompt once)."""
    from tests.support.models_fixtures import make_hf_model

    hf = policy_model(tmp_path / "hf")
    moe = make_hf_model(tmp_path / "moe", "qwen3_moe")
    config = job_config(hf, world=1)
    (errors,) = run_ranks(_guard_rank, 1, config, str(moe))
    assert len(errors) == 2, errors
    assert "needs packed micro-batches" in errors[0]
    assert "mixture-of-experts" in errors[1] and "shared_prefix=false" in errors[1]
