"""Rank functions that run a real vLLM engine inside forked training-like processes.

Run with `tests.support.forked.run_ranks(fn, world_size, ...)`: torch.distributed (gloo) is
initialized before `fn` runs, as in a colocated trainer. Each rank is a fresh process, so an
engine's process-wide side effects (gc.freeze, the thread-count no-op, vLLM's global parallel
state, default group creation) never leak into the pytest process.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from hybridrl.rollout.engine import RolloutEngine, RolloutEngineConfig
from hybridrl.rollout.sampling import RolloutSampling

# Small KV cache: the tiny models need a few blocks; the cache is committed memory on CPU.
KV_CACHE_BYTES = 4 << 20


OVER_BUDGET_STEP_TOKENS = 160


def make_engine(model_dir: str, infer_tp: int = 1, **overrides: Any) -> RolloutEngine:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    config = RolloutEngineConfig(
        model_path=model_dir, device="cpu", infer_tp=infer_tp, max_model_len=128,
        kv_cache_memory_bytes=KV_CACHE_BYTES, max_num_seqs=32, **overrides,
    )
    return RolloutEngine(config)


def layout_snapshot(rank: int, world_size: int, model_dir: str, infer_tp: int) -> dict[str, Any]:
    """What vLLM's own loader put in this rank's parameters, plus checks of the process state."""
    torch.manual_seed(1234 + rank)
    rng_before = torch.get_rng_state()
    engine = make_engine(model_dir, infer_tp=infer_tp, capture_loaded_weights=True)
    rng_kept = torch.equal(torch.get_rng_state(), rng_before)
    snapshot = engine.named_parameters_snapshot()
    # A short greedy decode: on TP peers it must agree (same seeds, same collectives).
    out = engine.generate_sequences([[1, 2, 3, 4]], RolloutSampling(temperature=0.0, max_tokens=4))
    engine.close()
    # The trainer's default group must survive vLLM's teardown.
    probe = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(probe)
    return {
        "snapshot": snapshot,
        "rng_kept": rng_kept,
        "responses": out.tensors["responses"],
        "default_group_sum": float(probe),
        "tp_rank": engine.tp_rank,
    }


def greedy_rollout(rank: int, world_size: int, model_dir: str, prompts: list[list[int]], max_tokens: int) -> Any:
    """One engine's greedy responses and their log-probs for `prompts` (a model of its own, e.g. a RoPE setting)."""
    from hybridrl.rollout.sampling import validation_sampling

    engine = make_engine(model_dir)
    try:
        return engine.generate_sequences(prompts, validation_sampling(max_tokens=max_tokens))
    finally:
        engine.close()


def generation_session(
    rank: int, world_size: int, model_dir: str, new_weights: list[dict[str, torch.Tensor]], long_prompt: list[int]
) -> dict[str, Any]:
    """Everything the generation tests check, from ONE engine (building one costs seconds).

    `new_weights`: HF state dicts to swap in, in order. Returns batches and snapshots by step name.
    """
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from hybridrl.rollout.engine import _reload_on_worker
    from hybridrl.rollout.sampling import validation_sampling
    from tests.support.rollout_models import load_config, load_state_dict

    # A scheduler step holds at most 160 tokens, so a batch of long prompts spans several steps (see
    # "over_budget" below); the other scenarios fit in one.
    engine = make_engine(model_dir, capture_loaded_weights=True, max_num_batched_tokens=OVER_BUDGET_STEP_TOKENS)
    config = load_config(model_dir)
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [3], long_prompt]
    greedy = validation_sampling(max_tokens=8)
    results: dict[str, Any] = {"prompts": prompts, "model_runner": engine.model_runner_class}

    results["greedy"] = engine.generate_sequences(prompts, greedy)
    results["sampled"] = engine.generate_sequences(
        prompts[:2], RolloutSampling(n=3, temperature=1.0, max_tokens=6, seed=7), uids=["a", "b"]
    )
    results["sampled_same_seed"] = engine.generate_sequences(
        prompts[:2], RolloutSampling(n=3, temperature=1.0, max_tokens=6, seed=7), uids=["a", "b"]
    )
    unseeded = RolloutSampling(n=2, temperature=1.0, max_tokens=6)
    results["unseeded"] = [engine.generate_sequences(prompts[:2], unseeded) for _ in range(2)]
    results["filtered"] = engine.generate_sequences(
        prompts[:2], RolloutSampling(n=4, temperature=0.7, top_k=5, top_p=0.9, max_tokens=6, seed=3)
    )
    results["filtered_top_p"] = engine.generate_sequences(
        prompts[:2], RolloutSampling(n=4, temperature=1.3, top_p=0.6, max_tokens=6, seed=5)
    )
    # vLLM's own sampler filter on fixed logits: the reference of the trainer-side truncation (vLLM is
    # imported here already; importing it in the pytest process would cost ~10 s)
    results["truncation_cases"] = vllm_truncation_cases()
    # Stop on the first greedy token of prompt 0 that did not occur before it: the response must
    # end right there (stop token included).
    # Seeded samples of prompts whose tokens exceed a step's budget: a prompt split over steps (vLLM's
    # chunked prefill) makes vLLM rewind the request's generator, which a CPU generator cannot.
    over_budget = [[(13 * p + 7 * i) % 120 + 3 for i in range(90)] for p in range(4)]
    results["over_budget"] = engine.generate_sequences(
        over_budget, RolloutSampling(n=2, temperature=1.0, max_tokens=6, seed=11)
    )
    first_response = results["greedy"].tensors["responses"][0].tolist()
    stop_token = next(t for i, t in enumerate(first_response) if i > 0 and t not in first_response[:i])
    results["stop_token"] = stop_token
    results["stopped"] = engine.generate_sequences(
        prompts[:1], validation_sampling(max_tokens=8, stop_token_ids=(stop_token,))
    )

    # Weight swaps. The long prompt fills a KV block, so it is served from the prefix cache.
    results["swaps"] = []
    for i, state_dict in enumerate(new_weights):
        weight_format = "hf" if i % 2 == 0 else "vllm_shard"
        if weight_format == "hf":
            engine.update_weights(state_dict.items(), weight_format="hf")
        else:
            engine.update_weights(hf_to_vllm_shards(state_dict, config, 1, 0).items(), weight_format="vllm_shard")
        results["swaps"].append({
            "format": weight_format,
            "greedy": engine.generate_sequences(prompts, greedy),
            "snapshot": engine.named_parameters_snapshot(),
        })

    results["repack_release"] = engine.llm.collective_rpc(
        repack_sees_previous_packing, args=(hf_to_vllm_shards(new_weights[-1], config, 1, 0),))[0]

    # Negative control: reload the original weights WITHOUT resetting the prefix cache; the cached
    # long prompt still carries K/V of the last swapped-in weights.
    engine.generate_sequences([long_prompt], greedy)
    engine.llm.collective_rpc(_reload_on_worker, args=(load_state_dict(model_dir).items(), True))
    results["stale"] = engine.generate_sequences([long_prompt], greedy)
    engine.llm.reset_prefix_cache()
    results["fresh"] = engine.generate_sequences([long_prompt], greedy)
    # The original weights again: multi-turn conversations through the agent loop.
    results["multi_turn"] = multi_turn_conversations(engine)
    results["stream"] = partial_rollout_across_a_swap(engine, new_weights[0])
    return results


def repack_sees_previous_packing(worker: Any, shards: dict[str, torch.Tensor]) -> dict[str, bool]:
    """A `vllm_shard` update on this worker, recording for each CPU layer vLLM repacks whether the GEMM
    closure of its previous packing (which holds oneDNN's packed copy of the weights) was still alive
    when the new packing was made: {layer: alive}."""
    import weakref

    from vllm.model_executor.layers import utils as vllm_layer_utils

    from hybridrl.rollout import vllm_patches
    from hybridrl.rollout.engine import _worker_model, _write_shards_on_worker

    model = _worker_model(worker)
    previous = {name: weakref.ref(getattr(module, vllm_patches.CPU_GEMM_ATTR))
                for name, module in model.named_modules() if hasattr(module, vllm_patches.CPU_GEMM_ATTR)}
    names = {module: name for name, module in model.named_modules()}
    alive: dict[str, bool] = {}
    dispatch = vllm_layer_utils.dispatch_cpu_unquantized_gemm

    def recording(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        name = names[layer]
        if name in previous:
            alive[name] = previous[name]() is not None
        return dispatch(layer, *args, **kwargs)

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = recording
    try:
        _write_shards_on_worker(worker, shards.items(), True)
    finally:
        vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    return alive


STREAM_STEPS_BEFORE_SWAP = 3


def partial_rollout_across_a_swap(engine: RolloutEngine, new_weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """fully_async's partial rollout: samples start under the engine's weights (version 0), are paused
    after a few engine steps, the weights are swapped (version 1), and they finish under the new ones."""
    from hybridrl.data.batch import Batch
    from hybridrl.rollout.continuous import ContinuousGeneration

    stream = ContinuousGeneration(engine)
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    rows = Batch({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, {"uid": np.array(["p0", "p1"], dtype=object)})
    stream.submit(prompts, ["p0", "p1"], RolloutSampling(n=3, temperature=1.0, max_tokens=8, seed=9,
                                                         ignore_eos=True), rows)
    early = stream.advance(0, min_groups=2, max_steps=STREAM_STEPS_BEFORE_SWAP)
    paused = stream.pause()
    engine.update_weights(new_weights.items(), weight_format="hf")
    resumed = stream.resume()
    finished = stream.advance(1, min_groups=2, max_steps=100)
    return {"early": len(early), "paused": paused, "resumed": resumed, "prompts": prompts,
            "groups": [batch for batch, _ in finished], "in_flight_after": stream.in_flight}


# ---- the trainer-side truncation's reference: vLLM's top-k/top-p filter --------------------------
TRUNCATION_VOCAB = 512


def truncation_case_logits() -> dict[str, tuple[torch.Tensor, float, int | None, float | None]]:
    """name -> (logits [rows, V], temperature, top_k, top_p). "ties" rows are rounded to halves, so
    many logits are equal, at the top-k and top-p boundaries too."""
    gen = torch.Generator().manual_seed(22)
    plain = 3 * torch.randn(16, TRUNCATION_VOCAB, generator=gen)
    ties = (2 * 3 * torch.randn(16, TRUNCATION_VOCAB, generator=gen)).round() / 2
    ties[0, :12] = ties[0].max() + 1  # 12 tokens tied at the top: top_k=10 cuts through them
    return {
        "top_k": (plain, 0.7, 7, None),
        "top_k_1": (plain, 1.0, 1, None),
        "top_p": (plain, 1.3, None, 0.8),
        "top_p_keeps_one": (plain, 0.5, None, 0.01),
        "top_k_top_p": (plain, 0.7, 50, 0.9),
        "ties_top_k": (ties, 1.0, 10, None),
        "ties_top_p": (ties, 0.9, None, 0.6),
        "ties_top_k_top_p": (ties, 1.3, 20, 0.7),
    }


def vllm_truncation_cases() -> dict[str, Any]:
    """name -> vLLM's log-softmax of each case's logits as its sampler builds it: float32, divided by
    the temperature, `apply_top_k_top_p` (dropped logits -inf), log-softmax (processed_logprobs)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    out = {}
    for name, (logits, temperature, top_k, top_p) in truncation_case_logits().items():
        rows = logits.shape[0]
        x = logits.float() / temperature
        k = None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32)
        p = None if top_p is None else torch.full((rows,), top_p, dtype=torch.float32)
        out[name] = apply_top_k_top_p(x.clone(), k, p).log_softmax(dim=-1, dtype=torch.float32)
    return out


# ---- multi-turn: the agent loop on the real engine ------------------------------------------------
MULTI_TURN_PROMPTS = [[5, 6, 7], [10, 11, 12, 13]]
MULTI_TURN_STOPS = tuple(range(40, 60))  # a random model stops a turn on one of these every ~6 tokens
MULTI_TURN_BUDGET = 90
ECHO_ANSWER = "ok"
ECHO_SCHEMA = {"type": "function", "function": {"name": "echo", "description": "answers ok", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class EveryTurnCallsEcho:
    """A tool-call parser for a random model, which never writes a real tool call: every turn calls
    `echo` (so every turn but the last is followed by an observation)."""

    def parse(self, text: str) -> Any:
        from hybridrl.tool_calling import ParsedTurn, ToolCall

        return ParsedTurn("", [ToolCall("echo", {"text": text[:3]}, 0)])


def multi_turn_conversations(engine: RolloutEngine, answer: str = ECHO_ANSWER) -> Any:
    from hybridrl.data.tokenizer import char_tokenizer
    from hybridrl.rollout.agent_loop import AgentLoop, AgentLoopSettings, ObservationRenderer
    from hybridrl.tool_calling import Tool, ToolRegistry, get_parser, register_parser

    register_parser("test_every_turn_calls_echo")(EveryTurnCallsEcho)
    tokenizer = char_tokenizer()  # its chat template renders the tool messages; ids >= 96 decode to ""
    registry = ToolRegistry([Tool(ECHO_SCHEMA, lambda text: answer)])
    agent = AgentLoop(registry, get_parser("test_every_turn_calls_echo"),
                      ObservationRenderer(tokenizer, engine.eos_token_ids), AgentLoopSettings(max_turns=3))
    sampling = RolloutSampling(n=2, temperature=1.0, max_tokens=MULTI_TURN_BUDGET, seed=5,
                               stop_token_ids=MULTI_TURN_STOPS)
    return engine.generate_multi_turn(MULTI_TURN_PROMPTS, sampling, agent, uids=["a", "b"])


def tp_update_session(
    rank: int, world_size: int, model_dir: str, new_weights: list[dict[str, torch.Tensor]], prompts: list[list[int]]
) -> dict[str, Any]:
    """infer_tp = world_size via external_launcher: sampling agrees across TP peers whose trainer
    RNGs differ, and both weight-update formats land each rank's own shard."""
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from hybridrl.rollout.sampling import validation_sampling
    from tests.support.rollout_models import load_config

    torch.manual_seed(100 + rank)  # a trainer whose RNG differs per rank
    engine = make_engine(model_dir, infer_tp=world_size, capture_loaded_weights=True)
    config = load_config(model_dir)
    results: dict[str, Any] = {
        "sampled": engine.generate_sequences(prompts, RolloutSampling(n=2, temperature=1.0, max_tokens=6)),
        "swaps": [],
    }
    for i, state_dict in enumerate(new_weights):
        if i % 2 == 0:
            shards = hf_to_vllm_shards(state_dict, config, world_size, engine.tp_rank)
            engine.update_weights(shards.items(), weight_format="vllm_shard")
        else:
            engine.update_weights(state_dict.items(), weight_format="hf")
        results["swaps"].append({
            "greedy": engine.generate_sequences(prompts, validation_sampling(max_tokens=8)),
            "snapshot": engine.named_parameters_snapshot(),
            "digests": engine.parameter_digests(),
        })
    # The agent loop with a tool whose answer differs per rank ("a" on TP rank 0, "b" on 1; one
    # character each, so a split would not even change the token counts): TP rank 0's answers are
    # what every rank's conversation continues from.
    results["multi_turn"] = multi_turn_conversations(engine, answer="ab"[engine.tp_rank])
    return results


def replica_groups_session(
    rank: int, world_size: int, model_dir: str, infer_tp: int, new_weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """world_size // infer_tp independent rollout replicas, each an infer_tp group, on one gloo world;
    each replica generates its own prompts. The engine is built as in production (no weight capture)."""
    from hybridrl.reshard.layout import hf_to_vllm_shards
    from hybridrl.rollout.sampling import validation_sampling
    from tests.support.rollout_models import load_config

    engine = make_engine(model_dir, infer_tp=infer_tp)
    replica = rank // infer_tp
    prompts = [[3 + replica, 4, 5]] if replica == 0 else [[9, 8, 7, 6], [1, 2]]
    out = engine.generate_sequences(prompts, validation_sampling(max_tokens=5))
    # The same prompt on every replica with engine-drawn seeds: replicas must sample independently.
    sampled = engine.generate_sequences([[5, 6, 7]], RolloutSampling(n=2, temperature=1.0, max_tokens=6))
    # ... and with a fixed seed (the trainer's per-step seed): reproducible on a replica, apart across them
    fixed = [engine.generate_sequences([[5, 6, 7]], RolloutSampling(n=2, temperature=1.0, max_tokens=6, seed=7))
             .tensors["responses"] for _ in range(2)]
    shards = hf_to_vllm_shards(new_weights, load_config(model_dir), infer_tp, engine.tp_rank)
    engine.update_weights(shards.items(), weight_format="vllm_shard")
    after_update = engine.generate_sequences(prompts, validation_sampling(max_tokens=5))
    try:
        engine.parameter_digests()
        digest_error = None
    except RuntimeError as error:
        digest_error = str(error)
    return {
        "replica": replica, "tp_rank": engine.tp_rank, "prompts": prompts,
        "responses": out.tensors["responses"], "sampled": sampled.tensors["responses"], "fixed": fixed,
        "after_update": after_update.tensors["responses"], "digest_error": digest_error,
    }
