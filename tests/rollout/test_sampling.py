"""Rollout pieces that need no engine: sampling params, per-device vLLM settings, batch assembly."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrl.rollout.engine import (
    RolloutEngineConfig,
    assemble_rollout_batch,
    model_eos_token_ids,
    request_seed,
    vllm_engine_kwargs,
)
from hybridrl.rollout.sampling import RolloutSampling, validation_sampling


def test_sampling_validation_lists_every_problem():
    with pytest.raises(ValueError) as error:
        RolloutSampling(n=0, temperature=-1, top_p=0, top_k=0, max_tokens=0, seed=-3)
    for fragment in ("n=0", "temperature=-1", "top_p=0", "top_k=0", "max_tokens=0", "seed=-3"):
        assert fragment in str(error.value)
    with pytest.raises(ValueError, match="greedy"):
        RolloutSampling(n=2, temperature=0.0)


def test_to_vllm_is_one_sample_with_explicit_seed_and_sampled_logprob_only():
    sampling = RolloutSampling(n=4, temperature=0.7, top_p=0.9, top_k=5, max_tokens=9, stop_token_ids=[2, 7])
    params = sampling.to_vllm(request_seed=123)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 0.7, 0.9, 5)
    assert (params.max_tokens, params.seed, params.logprobs) == (9, 123, 0)
    assert list(params.stop_token_ids) == [2, 7]
    assert RolloutSampling(top_k=None).to_vllm(None).top_k == 0  # disabled
    assert RolloutSampling(logprobs=False).to_vllm(None).logprobs is None


def test_validation_sampling_is_greedy_single_sample():
    sampling = validation_sampling(max_tokens=5, stop_token_ids=(3,))
    assert sampling.is_greedy and sampling.n == 1 and sampling.stop_token_ids == (3,)


def test_request_seeds_are_deterministic_and_distinct():
    seeds = {request_seed(0, call, p, s) for call in range(3) for p in range(4) for s in range(4)}
    assert len(seeds) == 48 and all(0 <= x < 2**31 for x in seeds)
    assert request_seed(5, 1, 2, 3) == request_seed(5, 1, 2, 3)


def test_engine_kwargs_keep_device_differences_in_one_place():
    config = RolloutEngineConfig(model_path="/m", max_model_len=256, kv_cache_memory_bytes=1 << 20)
    cpu = vllm_engine_kwargs(config, "cpu", distributed=False)
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True and cpu["block_size"] == 32
    assert cpu["kv_cache_memory_bytes"] == 1 << 20 and "gpu_memory_utilization" not in cpu
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["skip_tokenizer_init"] is True
    assert "distributed_executor_backend" not in cpu and "enable_sleep_mode" not in cpu
    assert "max_num_batched_tokens" not in cpu  # vLLM's default unless the job sets one
    budget = RolloutEngineConfig(model_path="/m", max_num_batched_tokens=4096)
    assert vllm_engine_kwargs(budget, "cpu", distributed=False)["max_num_batched_tokens"] == 4096
    # CPU generators cannot rewind after a partial prefill: whole-prompt prefill, whose budget must
    # hold a whole sequence (GPU keeps vLLM's chunked prefill).
    assert cpu["enable_chunked_prefill"] is False
    short = RolloutEngineConfig(model_path="/m", max_model_len=256, max_num_batched_tokens=255)
    with pytest.raises(ValueError, match="max_num_batched_tokens=255 is below max_model_len=256"):
        vllm_engine_kwargs(short, "cpu", distributed=False)
    assert vllm_engine_kwargs(short, "cuda", distributed=False)["max_num_batched_tokens"] == 255
    gpu = vllm_engine_kwargs(config, "cuda", distributed=False)
    assert gpu["dtype"] == "bfloat16" and gpu["enable_sleep_mode"] is True and gpu["enforce_eager"] is False
    assert "enable_chunked_prefill" not in gpu
    assert gpu["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in gpu
    assert gpu["disable_custom_all_reduce"] is True and "distributed_executor_backend" not in gpu
    # a TP1 replica inside the trainer's group takes its GPU from LOCAL_RANK, not vLLM's local rank 0
    colocated = vllm_engine_kwargs(config, "cuda", distributed=True)
    assert colocated["distributed_executor_backend"] == "external_launcher" and colocated["tensor_parallel_size"] == 1
    assert "distributed_executor_backend" not in vllm_engine_kwargs(config, "cpu", distributed=True)
    tp2 = RolloutEngineConfig(model_path="/m", infer_tp=2)
    assert vllm_engine_kwargs(tp2, "cpu", distributed=True)["distributed_executor_backend"] == "external_launcher"
    with pytest.raises(RuntimeError, match="initialize torch.distributed"):
        vllm_engine_kwargs(tp2, "cpu", distributed=False)
    with pytest.raises(ValueError, match="sleep"):
        vllm_engine_kwargs(RolloutEngineConfig(model_path="/m", enable_sleep_mode=True), "cpu", distributed=False)
    # routed-experts capture (routing replay): asked for only when on; on every device hybridrl's hook on
    # vLLM's V1 runner (vLLM's own output needs Model Runner V2), which sees only computed tokens: no
    # prefix caching
    assert cpu["enable_prefix_caching"] is True and gpu["enable_prefix_caching"] is True
    capture = RolloutEngineConfig(model_path="/m", return_routed_experts=True)
    for device in ("cuda", "cpu"):
        kwargs = vllm_engine_kwargs(capture, device, distributed=False)
        assert "enable_return_routed_experts" not in kwargs and kwargs["enable_prefix_caching"] is False
    # MoE experts: Triton's kernel on GPUs (the checkpoint layout the resharder writes), vLLM's CPU experts
    assert gpu["moe_backend"] == "triton" and "moe_backend" not in cpu


def test_the_gpu_moe_backend_keeps_the_layout_the_resharder_writes():
    """vLLM's own post-load conversion (`convert_to_unquantized_kernel_format`) of the expert weights: Triton's
    experts (what the engine names on GPUs) keep [E, 2I, H] as [gate; up] and [E, H, I]; FlashInfer's CUTLASS
    experts, which vLLM would prefer on Blackwell, swap w13's halves, so a shard written there in checkpoint
    order would compute up x silu(gate)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        convert_to_unquantized_kernel_format,
        map_unquantized_backend,
    )

    from hybridrl.parallel.device_policy import CUDA

    backend = map_unquantized_backend(CUDA.vllm_moe_backend)
    assert backend == UnquantizedMoeBackend.TRITON
    w13, w2 = torch.randn(4, 2 * 6, 8), torch.randn(4, 8, 6)  # [E, gate 6 + up 6, H], [E, H, I]
    gated = SimpleNamespace(is_act_and_mul=True)  # the part of vLLM's FusedMoEConfig these branches read
    kept13, kept2 = convert_to_unquantized_kernel_format(backend, gated, w13.clone(), w2.clone())
    assert torch.equal(kept13, w13) and torch.equal(kept2, w2)
    swapped13, _ = convert_to_unquantized_kernel_format(UnquantizedMoeBackend.FLASHINFER_CUTLASS, gated,
                                                        w13.clone(), w2.clone())
    assert torch.equal(swapped13, torch.cat([w13[:, 6:], w13[:, :6]], dim=1))


def test_eos_ids_come_from_generation_config_then_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert model_eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert model_eos_token_ids(tmp_path) == (5, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert model_eos_token_ids(tmp_path) == ()


def _output(tokens: list[int], logprobs: list[float], finish: str) -> SimpleNamespace:
    """The fields of a vLLM RequestOutput that the assembly reads."""
    entries = [{tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(tokens, logprobs)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=entries, finish_reason=finish)])


def test_assembly_pads_masks_and_positions_by_hand():
    prompts = [[11, 12, 13], [21]]
    outputs = [
        _output([31, 32], [-0.1, -0.2], "stop"),        # prompt 0, sample 0
        _output([41, 42, 43], [-1.0, -2.0, -3.0], "length"),  # prompt 0, sample 1
        _output([51], [-0.5], "stop"),                  # prompt 1, sample 0
        _output([61, 62, 63], [-4.0, -5.0, -6.0], "length"),
    ]
    sampling = RolloutSampling(n=2, max_tokens=3)
    batch = assemble_rollout_batch(prompts, outputs, sampling, pad_token_id=99, uids=["x", "y"])
    t = batch.tensors
    assert t["prompts"].tolist() == [[11, 12, 13], [11, 12, 13], [99, 99, 21], [99, 99, 21]]
    assert t["responses"].tolist() == [[31, 32, 99], [41, 42, 43], [51, 99, 99], [61, 62, 63]]
    assert t["input_ids"].tolist()[2] == [99, 99, 21, 51, 99, 99]
    assert t["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1],
    ]
    assert t["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    # Real tokens count from 0; the response continues after the prompt's last position.
    assert t["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3], [0, 0, 0, 1, 2, 3],
    ]
    assert torch.equal(t["rollout_log_probs"], torch.tensor(
        [[-0.1, -0.2, 0.0], [-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [-4.0, -5.0, -6.0]]))
    assert t["response_lengths"].tolist() == [2, 3, 1, 3]
    assert list(batch["uid"]) == ["x", "x", "y", "y"]
    assert np.array_equal(batch["prompt_index"], [0, 0, 1, 1])
    assert np.array_equal(batch["sample_index"], [0, 1, 0, 1])
    assert list(batch["finish_reason"]) == ["stop", "length", "stop", "length"]
    # GRPO groups by uid: splitting keeps metadata aligned with rows.
    assert list(batch.split(2)[1]["uid"]) == ["y", "y"]


def test_assembly_refuses_a_wrong_output_count():
    with pytest.raises(ValueError, match="3 outputs for 2 prompts x n=2"):
        assemble_rollout_batch([[1], [2]], [_output([1], [0.0], "stop")] * 3, RolloutSampling(n=2), 0)
