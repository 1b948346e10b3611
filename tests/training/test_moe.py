"""A mixture-of-experts actor update on forked gloo ranks (no Ray): expert parallelism changes
where the experts live and how their gradients are reduced, not the step.

At EP2 each rank holds half the experts and megatron's alltoall dispatcher sends it the tokens of
both DP ranks routed to them; the expert gradients then reduce over the expert-data-parallel group
(size 1 here) while the dense ones reduce over DP. Loss, grad norm and the updated weights must equal
the single-rank step's and the EP1 step's at the same DP.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, safetensors_state
from tests.support.training_fixtures import job_config, rollout_batch, update_rank

# (world, ep, expert TP, token dispatcher); the first is the single-rank reference
MOE_LAYOUTS = ((1, 1, None, "alltoall"), (2, 1, None, "alltoall"), (2, 2, None, "alltoall"),
               (2, 2, None, "allgather"), (2, 1, 2, "alltoall"), (2, 1, 2, "allgather"))


def micro_widths(batch: Any, dp: int, micro: int) -> list[list[int]]:
    """Each DP rank's micro-batch widths (longest real row) as the actor cuts them (fixed size)."""
    widths = []
    for chunk in batch.split(dp):
        lengths = chunk.tensors["attention_mask"].sum(dim=1)
        widths.append([int(lengths[i:i + micro].max()) for i in range(0, lengths.shape[0], micro)])
    return widths


@pytest.mark.slow
def test_moe_update_at_ep2_equals_ep1(tmp_path):
    """EP2 and TP1 x ETP2 (each expert split over the two DP ranks, which then see both ranks' tokens)
    equal EP1 and one rank, with either of megatron's token dispatchers. The allgather one gathers
    equal shares over the expert TP x EP group, whose two ranks cut different rows here: their
    micro-batches differ in width (checked), so it runs only because the backend pads them to the
    batch's width (without that its all-gather fails on the unequal shapes)."""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7)
    batch = rollout_batch(8)
    widths = micro_widths(batch, 2, 2)
    assert widths[0] != widths[1], widths
    runs: dict[tuple[int, int, int | None, str], tuple[Any, dict]] = {}
    for world, ep, etp, dispatcher in MOE_LAYOUTS:
        out = tmp_path / f"out_w{world}ep{ep}etp{etp}{dispatcher}"
        config = job_config(hf, world=world, use_kl_loss=True, entropy_coeff=0.01)
        mc = config.actor_rollout_ref.actor.megatron
        mc.expert_model_parallel_size, mc.expert_tensor_parallel_size = ep, etp
        mc.moe_token_dispatcher_type = dispatcher
        results = run_ranks(update_rank, world, config, batch, str(out), timeout_s=400)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert len(metrics) == world  # one output rank per DP replica
        if ep > 1 or etp:  # different experts or expert halves (same local names), the same dense weights
            mine, theirs = results[0]["digests"], results[1]["digests"]
            experts = [n for n in mine if "local_experts" in n]
            assert experts and all(mine[n] != theirs[n] for n in experts)
            assert all(mine[n] == theirs[n] for n in mine if "local_experts" not in n)
        runs[world, ep, etp, dispatcher] = (metrics[0], safetensors_state(out))
    assert_same_step(runs, MOE_LAYOUTS[0], safetensors_state(hf))


def assert_same_step(runs: dict[Any, tuple[Any, dict]], reference: Any, initial: dict) -> None:
    """Every layout's loss, grad norm, KL and updated weights equal the reference layout's (1e-5), and the
    step moved the experts."""
    base_metrics, base_state = runs[reference]
    for key, (metrics, state) in runs.items():
        assert abs(metrics.pg_loss - base_metrics.pg_loss) < 1e-5, key
        assert abs(metrics.grad_norm - base_metrics.grad_norm) < 1e-5, key
        assert abs(metrics.kl_loss - base_metrics.kl_loss) < 1e-5, key
        assert sorted(state) == sorted(base_state)
        for name, value in base_state.items():
            assert (state[name] - value).abs().max() <= 1e-5, (key, name)
    experts = [n for n in initial if ".experts." in n]
    assert experts and max((base_state[n] - initial[n]).abs().max() for n in experts) > 1e-3  # experts moved


def _router_update_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    """One update with every training router call's input and weight recorded (plain hooks)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    calls: list[tuple[int, Any, Any]] = []

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            calls.append((module.layer_number, args[0].detach().clone(), module.weight.detach().clone(),
                          padding.detach().clone()))

    for chunk in backend.chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_pre_hook(record, with_kwargs=True)
    chunk = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
    return {"metrics": actor.update_policy(chunk), "calls": calls}


def _reference_router_figures(calls: list[tuple[int, Any, Any, Any]], top_k: int,
                              micro_lengths: list[Any]) -> tuple[float, float, float]:
    """megatron's load-balancing loss (Switch: E / (k T^2) * sum_e P_e N_e per micro-batch, P_e the
    summed softmax over all experts, N_e the tokens whose top-k holds e), averaged over calls and
    layers; the z-loss (mean over tokens of logsumexp(logits)^2), averaged the same way; and the mean
    over layers of max/mean tokens per expert: in float64 from the router's input and weight, over the
    real tokens only. Which tokens are real comes from the rows (`micro_lengths`: each call's micro-batch
    row lengths, the layers of a micro-batch in order), not from the mask megatron was given, which
    must equal it."""
    losses: dict[int, list[float]] = {}
    z_losses: dict[int, list[float]] = {}
    counts: dict[int, Any] = {}
    for (layer, hidden, weight, padding), lengths in zip(calls, micro_lengths):
        width = hidden.shape[0]  # [s, b, h]
        expected = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)  # [b, s]: after the real run
        assert torch.equal(padding.cpu().t(), expected), (layer, padding, lengths)  # the router's is [s, b]
        real = ~expected.t().reshape(-1)  # the routing order: s-major
        logits = (hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().t())[real]
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
        tokens, experts = probs.shape
        loss = experts / (top_k * tokens**2) * (probs.sum(0) * chosen.sum(0)).sum()
        losses.setdefault(layer, []).append(float(loss))
        z_losses.setdefault(layer, []).append(float(torch.logsumexp(logits, dim=-1).square().mean()))
        counts[layer] = counts.get(layer, 0) + chosen.sum(0)
    aux = sum(sum(v) / len(v) for v in losses.values()) / len(losses)
    z = sum(sum(v) / len(v) for v in z_losses.values()) / len(z_losses)
    imbalance = sum(float(c.max() / c.mean()) for c in counts.values()) / len(counts)
    return aux, z, imbalance


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2)])
def test_router_aux_loss_and_imbalance_are_megatrons(tmp_path, world, ep):

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=8)
    batch = rollout_batch(8)
    config = job_config(hf, world=world)
    # padded micro-batches: the subject is the mask over each row's padding columns ([b, s] after its
    # real run), which the packed layout (the CPU default) has almost none of
    config.actor_rollout_ref.model.use_remove_padding = False
    mc = config.actor_rollout_ref.actor.megatron
    mc.expert_model_parallel_size, mc.moe_aux_loss_coeff, mc.moe_z_loss_coeff = ep, 0.01, 0.001
    results = run_ranks(_router_update_rank, world, config, batch, timeout_s=400)
    top_k, moe_layers = 2, 3  # the MoE layers 0, 1, 3 (layer 2 is dense)
    micro = config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    calls, micro_lengths = [], []
    for rank, result in enumerate(results):
        assert len({c[0] for c in result["calls"]}) == moe_layers
        # this DP rank's rows, micro-batch by micro-batch (the update keeps their order here): each
        # row's real tokens, prompt then response, sit from column 0 in the model's aligned layout
        lengths = batch.split(world)[rank].tensors["attention_mask"].sum(dim=1)
        for start in range(0, lengths.shape[0], micro):
            micro_lengths += [lengths[start:start + micro]] * moe_layers
        calls += result["calls"]
    assert any(m.min() < m.max() for m in micro_lengths)  # some micro-batch holds padding
    # the DP ranks' micro-batches are separate loss terms: the metric averages them all
    aux, z, imbalance = _reference_router_figures(calls, top_k, micro_lengths)
    for result in results:
        metrics = result["metrics"].as_dict()
        assert metrics["actor/moe_aux_loss"] == pytest.approx(aux, rel=1e-5)
        assert metrics["actor/moe_z_loss"] == pytest.approx(z, rel=1e-5)
        assert metrics["actor/moe_expert_imbalance"] == pytest.approx(imbalance, rel=1e-9)
        assert 1.0 <= imbalance <= 8 / top_k
        assert metrics["actor/moe_dropped_token_fraction"] == 0.0  # no capacity: every routing kept
    assert 0 < aux < 10  # Switch's loss is top_k-normalized: 1 when perfectly balanced


def test_moe_at_cp2_packed_equals_transformers_and_cp1(tmp_path):
    """An MoE model at CP2 on packed micro-batches (the CPU default): its dense and MoE layers' core
    attention is the CPU stand-in too, so the log-probs equal transformers' and one update with the
    load-balancing loss on equals padded CP1's (loss, grad norm, aux loss, every weight). The loss is config.json's:
    its router_aux_loss_coef with output_router_logits true, as transformers would train the model (the job sets
    no coefficient)."""
    from tests.support.rank_passes import log_prob_rank, weights_update_rank, with_cp
    from tests.support.training_fixtures import hf_response_log_probs

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, output_router_logits=True, router_aux_loss_coef=0.01)
    batch = rollout_batch(8, seed=9)
    ref_lp, _ = hf_response_log_probs(hf, batch)
    config = with_cp(job_config(hf, world=2, micro=4), 2, packed=True)
    (log_probs,) = [r["out"]["old_log_probs"] for r in run_ranks(log_prob_rank, 2, config, batch)
                    if r["out"] is not None]
    assert (log_probs - ref_lp).abs().max() <= 1e-5 and ref_lp.abs().max() > 1e-2
    runs = {}
    for cp, packed in ((1, False), (2, True)):
        config = with_cp(job_config(hf, world=cp, micro=2, use_kl_loss=True), cp, packed)
        assert config.actor_rollout_ref.actor.megatron.moe_aux_loss_coeff is None
        (runs[cp],) = [r for r in run_ranks(weights_update_rank, cp, config, batch) if r["metrics"] is not None]
        assert runs[cp]["aux_loss_coeff"] == 0.01
    m1, m2 = runs[1]["metrics"], runs[2]["metrics"]
    for name in ("pg_loss", "grad_norm", "kl_loss"):
        assert abs(getattr(m2, name) - getattr(m1, name)) <= 1e-5, name
    assert m2.as_dict()["actor/moe_aux_loss"] == pytest.approx(m1.as_dict()["actor/moe_aux_loss"], rel=1e-5)
    # Adam at lr 1e-2 turns fp32 summation-order noise in small expert gradients into ~1e-5 weight
    # differences (measured: 9.6e-6 at most); a wrong layout moves weights by ~1e-2
    for name, value in runs[1]["weights"].items():
        assert (runs[2]["weights"][name] - value).abs().max() <= 3e-5, name


def _capacity_update_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    """One update with every training router call's input, weight, padding and output map recorded."""
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    calls: list[dict[str, Any]] = []

    def record(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            calls.append({"layer": module.layer_number, "hidden": args[0].detach().clone(),
                          "weight": module.weight.detach().clone(), "padding": padding.detach().clone(),
                          "map": output[1].detach().clone()})

    for chunk in backend.chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(record, with_kwargs=True)
    chunk = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
    return {"metrics": actor.update_policy(chunk), "calls": calls}


def _reference_routing(call: dict[str, Any], top_k: int) -> tuple[Any, Any]:
    """(top-k map, routing probabilities) of one router call in float64 from its input and weight,
    before any capacity: Qwen3-MoE with norm_topk_prob renormalizes the softmax over the chosen experts."""
    hidden, weight = call["hidden"], call["weight"]
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().t()
    top = logits.topk(top_k, dim=-1)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros_like(logits).scatter_(1, top.indices, torch.softmax(top.values, dim=-1))
    return chosen, probs


@pytest.mark.slow
@pytest.mark.parametrize("policy,pad", [("probs", False), ("position", True)])
def test_capacity_drops_are_counted(tmp_path, policy, pad):
    """With an expert capacity small enough to drop, megatron keeps at most `capacity` of each expert's
    routed tokens (padding columns included, as megatron counts them), and
    actor/moe_dropped_token_fraction is the share of the real tokens' top-k assignments it dropped:
    counted here from float64 routing recomputed from each router call's input (EP2: the ranks route
    their own rows; the second case pads expert inputs to capacity, with the batch's full width on
    both ranks, and drops by position)."""
    import math

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=8)
    batch = rollout_batch(8)
    config = job_config(hf, world=2)
    mc = config.actor_rollout_ref.actor.megatron
    mc.expert_model_parallel_size, mc.moe_expert_capacity_factor = 2, 0.5
    mc.moe_token_drop_policy, mc.moe_pad_expert_input_to_capacity = policy, pad
    results = run_ranks(_capacity_update_rank, 2, config, batch, timeout_s=400)
    top_k, experts = 2, 8
    assigned = dropped = 0
    for result in results:
        for call in result["calls"]:
            chosen, probs = _reference_routing(call, top_k)
            tokens = chosen.shape[0]  # every column, padding included: megatron's capacity counts them
            capacity = math.ceil(tokens * top_k / experts * 0.5)
            kept = call["map"].cpu() & chosen  # with padding to capacity the map also marks empty slots
            assert capacity < tokens
            assert torch.equal(kept.sum(0), chosen.sum(0).clamp(max=capacity)), (call["layer"], capacity)
            if policy == "probs":  # each expert keeps its `capacity` most probable tokens
                by_probs = probs.topk(capacity, dim=0).indices
                expected = chosen & torch.zeros_like(chosen).scatter_(0, by_probs, True)
                assert torch.equal(kept, expected), call["layer"]
            real = ~call["padding"].cpu().reshape(-1)  # [s, b] in the router's token order
            assigned += top_k * int(real.sum())
            dropped += top_k * int(real.sum()) - int(kept[real].sum())
    assert 0 < dropped < assigned
    for result in results:
        fraction = result["metrics"].as_dict()["actor/moe_dropped_token_fraction"]
        assert fraction == pytest.approx(dropped / assigned, rel=1e-12)


def _log_probs_rank(rank: int, world: int, config: Any, batch: Any) -> dict[str, Any]:
    """The actor's log-probs of `batch`: routed as configured, freely (the sync's probe), and again."""
    from hybridrl.config.plan import build_plan
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    actor = MegatronActor(MegatronBackend(role_spec(plan, "actor")), plan)
    capped = actor.compute_log_prob(batch)["old_log_probs"]
    free = actor.compute_log_prob(batch, free_routing=True)["old_log_probs"]
    again = actor.compute_log_prob(batch)["old_log_probs"]
    return {"capped": capped, "free": free, "again": again}


@pytest.mark.slow
@pytest.mark.parametrize("pad", [False, True])
def test_probe_forward_keeps_every_token(tmp_path, pad):
    """The weight sync's probe (free routing) runs without the expert capacity, as vLLM does: its
    log-probs equal transformers' while the configured (capped) forward's do not, and the capacity is
    back for the next forward (with padding to capacity, the alltoall dispatcher's own drop-and-pad
    mode is switched off and on too)."""
    from tests.support.training_fixtures import hf_response_log_probs

    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=8)
    batch = rollout_batch(8)
    config = job_config(hf, world=1)
    mc = config.actor_rollout_ref.actor.megatron
    mc.moe_expert_capacity_factor, mc.moe_pad_expert_input_to_capacity = 0.5, pad
    (result,) = run_ranks(_log_probs_rank, 1, config, batch, timeout_s=300)
    reference, _ = hf_response_log_probs(hf, batch)
    assert (result["free"] - reference).abs().max() <= 1e-5
    assert (result["capped"] - reference).abs().max() > 1e-3  # tokens were dropped
    assert torch.equal(result["again"], result["capped"])


@pytest.mark.slow
def test_moe_update_at_pp2_and_pp2_ep2_equals_one_rank(tmp_path):
    """issue 41 item 1: a pipeline over the MoE model (PP2, and PP2 x EP2 on four ranks: the experts of each
    stage split over its two DP ranks) gives the single-rank step's loss, grad norm and updated weights, every
    expert's included."""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7)
    batch = rollout_batch(8)
    runs = {}
    for world, pp, ep in ((1, 1, 1), (2, 2, 1), (4, 2, 2)):
        out = tmp_path / f"out_w{world}pp{pp}ep{ep}"
        config = job_config(hf, world=world, pp=pp, use_kl_loss=True, entropy_coeff=0.01)
        config.actor_rollout_ref.actor.megatron.expert_model_parallel_size = ep
        results = run_ranks(update_rank, world, config, batch, str(out), timeout_s=600)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        runs[world, pp, ep] = (metrics[0], safetensors_state(out))
    assert_same_step(runs, (1, 1, 1), safetensors_state(hf))


@pytest.mark.slow
def test_moe_update_at_tp2_with_whole_experts_equals_one_rank(tmp_path):
    """TP2 with sequence parallelism and expert TP 1 (verl's MoE scripts run TP 4 or 8 × ETP 1): the dense layers
    split over TP, every expert whole. At EP1 the two TP ranks hold the same experts, each routing its half of the
    sequence (the expert gradients then sum over those ranks, megatron's expert-DP group); at EP2 on four ranks
    each holds half the experts. The step's loss, grad norm and every updated weight equal the single rank's."""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7)
    batch = rollout_batch(8)
    runs = {}
    for world, tp, ep, etp in ((1, 1, 1, None), (2, 2, 1, 1), (4, 2, 2, 1)):
        out = tmp_path / f"out_w{world}tp{tp}ep{ep}etp{etp}"
        config = job_config(hf, world=world, tp=tp, use_kl_loss=True, entropy_coeff=0.01)
        mc = config.actor_rollout_ref.actor.megatron
        mc.sequence_parallel = tp > 1
        mc.expert_model_parallel_size, mc.expert_tensor_parallel_size = ep, etp
        results = run_ranks(update_rank, world, config, batch, str(out), timeout_s=600)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        assert metrics, (world, tp, ep)
        if tp > 1 and ep == 1:  # both TP ranks hold every expert whole, and the same after the step
            mine, theirs = results[0]["digests"], results[1]["digests"]
            experts = [n for n in mine if "local_experts" in n]
            assert experts and all(mine[n] == theirs[n] for n in experts)
        runs[world, tp, ep, etp] = (metrics[0], safetensors_state(out))
    assert_same_step(runs, (1, 1, 1, None), safetensors_state(hf))


def _aux_gradient_rank(rank: int, world: int, config: Any, batch: Any, out_dir: str) -> dict[str, Any]:
    """The gradient the load-balancing and z-losses add to one actor update, exported under HF names: the update
    runs with the configured coefficients, then again on the same weights with both off (the optimizer's step
    replaced by keeping megatron's reduced gradients, `main_grad`), and the difference is what the two losses
    added."""
    from hybridrl.config.plan import build_plan
    from hybridrl.models.bridge import export_hf
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    params = [p for chunk in backend.chunks for p in chunk.parameters()]
    grads: list[list[torch.Tensor]] = []

    def keep_gradients() -> tuple[bool, float, None]:
        grads.append([p.main_grad.detach().clone() for p in params])
        return True, 0.0, None

    backend.optimizer.step = keep_gradients
    chunk = batch.split(backend.ctx.dp)[backend.ctx.dp_rank]
    transformer = backend.config  # the chunks' shared TransformerConfig, which the routers read each forward
    assert transformer.moe_aux_loss_coeff > 0 and transformer.moe_z_loss_coeff > 0  # the job's, through the plan
    metrics = actor.update_policy(chunk)
    transformer.moe_aux_loss_coeff, transformer.moe_z_loss_coeff = 0.0, None
    actor.update_policy(chunk)
    with torch.no_grad():
        for param, with_losses, without in zip(params, *grads, strict=True):
            param.copy_(with_losses - without)
    export_hf(backend.chunks, out_dir, force=True)
    return {"metrics": metrics}


def _reference_aux_gradient(hf: Any, batch: Any, dp: int, micro: int, aux_coeff: float, z_coeff: float,
                            top_k: int, whole_rank: bool = False) -> dict[str, torch.Tensor]:
    """The gradient of megatron's router losses as a DP x micro-batch update applies them, from transformers'
    Qwen3-MoE in float64: per micro-batch (`micro` consecutive rows of a DP rank's share) and MoE layer, the
    Switch load-balancing loss E / (k T^2) * sum_e P_e N_e (P_e the summed softmax over every expert, N_e the
    tokens whose top-k holds e, not differentiated) and the z-loss mean(logsumexp(logits)^2), over the real
    tokens only; the layers' losses add, the micro-batches of every DP rank average (megatron scales them by
    1/num_microbatches, DDP averages over DP). `whole_rank`: one loss over each rank's share instead (a wrong
    grouping, to show the comparison can tell)."""
    import transformers

    from tests.support.models_fixtures import checkpoint_named_grads

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    total = torch.zeros((), dtype=torch.float64)
    for share in batch.split(dp):
        ids, mask = share.tensors["input_ids"], share.tensors["attention_mask"].bool()
        # each row alone, its real tokens only (prompt then response, positions from 0): one [T, E] per MoE layer
        rows = [model(ids[i][mask[i]].unsqueeze(0), output_router_logits=True).router_logits
                for i in range(ids.shape[0])]
        size = ids.shape[0] if whole_rank else micro
        groups = [range(start, min(start + size, ids.shape[0])) for start in range(0, ids.shape[0], size)]
        for group in groups:
            for layer in range(len(rows[0])):
                logits = torch.cat([rows[i][layer] for i in group])
                probs = torch.softmax(logits, dim=-1)
                chosen = torch.zeros_like(probs).scatter_(1, probs.detach().topk(top_k, dim=-1).indices, 1.0)
                tokens, experts = probs.shape
                aux = experts / (top_k * tokens**2) * (probs.sum(0) * chosen.sum(0)).sum()
                z = torch.logsumexp(logits, dim=-1).square().mean()
                total = total + (aux_coeff * aux + z_coeff * z) / (dp * len(groups))
    total.backward()
    return checkpoint_named_grads(model, "qwen3_moe")


@pytest.mark.slow
def test_router_loss_gradients_equal_a_float64_reference(tmp_path):
    """issue 41 item 2: what the load-balancing (aux) loss and the z-loss add to an update's gradient, on every
    weight (the routers, and through the routed hidden states attention, norms, embeddings and the experts of
    earlier layers), equals the float64 gradient of megatron's definition computed from transformers' model: per
    micro-batch and layer over the real tokens, averaged over the micro-batches of every DP rank. At one rank
    (4 micro-batches), DP2 and DP2 x EP2 (2 each: the reference changes with the layout), packed (the CPU
    default) and padded micro-batches (padding kept out of both losses)."""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=8)
    batch = rollout_batch(8)
    aux_coeff, z_coeff, top_k, micro = 0.1, 0.01, 2, 2
    references = {dp: _reference_aux_gradient(hf, batch, dp, micro, aux_coeff, z_coeff, top_k) for dp in (1, 2)}
    for world, ep, packed in ((1, 1, True), (2, 1, True), (2, 2, True), (2, 2, False)):
        out = tmp_path / f"grads_w{world}ep{ep}{'packed' if packed else 'padded'}"
        config = job_config(hf, world=world, micro=micro)
        config.actor_rollout_ref.model.use_remove_padding = packed
        mc = config.actor_rollout_ref.actor.megatron
        mc.expert_model_parallel_size, mc.moe_aux_loss_coeff, mc.moe_z_loss_coeff = ep, aux_coeff, z_coeff
        run_ranks(_aux_gradient_rank, world, config, batch, str(out), timeout_s=400)
        errors = _relative_errors(safetensors_state(out), references[world])
        # measured: 3.4e-6 at most (float32 against float64); parameters the losses do not reach (the last MoE
        # layer's experts, the final norm, the output layer) get exactly nothing
        assert max(errors.values()) <= 2e-5, (world, ep, packed, max(errors.items(), key=lambda kv: kv[1]))
    reached = {n for n, g in references[1].items() if g.abs().max() > 0}
    assert {n for n in references[1] if "self_attn" in n and "layers.3" not in n} <= reached  # past the routers
    assert not any(n.startswith(("lm_head", "model.norm")) or "layers.3.mlp.experts" in n for n in reached)
    # the comparison tells the micro-batch grouping apart: one loss over each rank's rows is another gradient
    whole = _reference_aux_gradient(hf, batch, 2, micro, aux_coeff, z_coeff, top_k, whole_rank=True)
    assert max(_relative_errors(whole, references[2]).values()) > 1e-2


def _relative_errors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: the largest difference from the reference relative to the reference's largest magnitude
    (the absolute difference where the reference is all zero)."""
    assert sorted(ours) == sorted(reference)
    return {n: float((ours[n].double() - g).abs().max()) / (float(g.abs().max()) or 1.0) for n, g in reference.items()}


@pytest.mark.slow
def test_moe_update_with_virtual_pipeline_equals_one_rank(tmp_path):
    """issue 41 item 1, VPP: megatron's interleaved schedule over an MoE model (PP3 x VPP2 on three ranks, each
    holding two one-layer chunks: MoE, dense and MoE layers on every stage) gives the single rank's loss, grad norm
    and updated weights, every expert's included. (A trained role takes VPP from PP 3: `hybridrl plan`.)"""
    hf = make_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, num_hidden_layers=6, mlp_only_layers=[2, 3])
    batch = rollout_batch(12)  # 6 prompts: the plan splits them over 3 rollout replicas
    runs = {}
    for world, pp, vpp in ((1, 1, None), (3, 3, 2)):
        out = tmp_path / f"out_w{world}pp{pp}vpp{vpp}"
        config = job_config(hf, world=world, pp=pp, vpp=vpp, rows=12, use_kl_loss=True, entropy_coeff=0.01)
        results = run_ranks(update_rank, world, config, batch, str(out), timeout_s=600)
        if vpp:  # two model chunks on every rank, each with experts or the dense MLP
            assert all({name.split(".")[0] for name in r["digests"]} == {"0", "1"} for r in results)
        metrics = [r["metrics"] for r in results if r["metrics"] is not None]
        runs[world, pp, vpp] = (metrics[0], safetensors_state(out))
    assert_same_step(runs, (1, 1, None), safetensors_state(hf))
