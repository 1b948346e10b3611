"""The plan's predicted step time (`config.step_time`) against the roofline written out here by hand: each phase's
FLOPs, bytes and links at the hardware's datasheet figures and the stated efficiencies; the hardware descriptions
(shipped, a user's file, mistakes refused at plan time).

The FLOPs of a phase come from the plan (`Plan.step_flops`, tested against hand-computed FLOPs in
tests/config/test_distillation.py); everything this module adds on top is recomputed here.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, plan_from_sources
from hybridrl.config.estimates import decoder_flops_per_token, forward_flops
from hybridrl.config.hardware import EFFICIENCY, SHIPPED, Hardware, HardwareError, load_hardware
from hybridrl.config.plan import PASS_PHASES
from hybridrl.config.report import render_plan
from hybridrl.config.step_time import (
    PROBE_TOKENS,
    PhaseTime,
    StepLengths,
    StepTime,
    predict_step_time,
    seconds_text,
    synced_tensors,
    time_vs_plan,
)
from hybridrl.names import Phase

ROOT = Path(__file__).resolve().parents[2]
QWEN_7B = str(ROOT / "configs/examples/qwen2.5_7b_grpo_8gpu.yaml")
LLAMA_70B = str(ROOT / "configs/examples/llama3_70b_ppo_16x8.yaml")
GIB = 2**30
H100 = SHIPPED["h100-sxm"]


def test_the_7b_grpo_steps_phases_are_the_roofline_by_hand():
    """Qwen2.5-7B GRPO on 8 H100s (the example: actor TP2 x DP4 with the distributed optimizer, vLLM TP2 x 4
    replicas, 256 prompts x 8 samples of 1024 + 2048 tokens, gradient checkpointing)."""
    plan = plan_from_sources(QWEN_7B)
    step = predict_step_time(plan, H100)
    flops = dict(plan.step_flops)
    # the update: 3 forwards (+1 recomputed: 4/3) over 8 GPUs at 40 % of 989 TFLOP/s; per optimizer step (4) a
    # reduce-scatter of the fp32 grads (14.185 GiB a rank) and an all-gather of the bf16 params (7.093 GiB) over
    # DP4 (3/4 of each) on NVLink (a DP group spans 8 ranks of one machine) at 70 % of 450 GB/s, and Adam's 28
    # bytes a parameter over the rank's quarter of its 7.093 GiB / 2 bytes at 50 % of 3350 GB/s
    compute = flops[Phase.UPDATE_ACTOR] * 4 / 3 / 8 / (989e12 * 0.40)
    ring = 0.75 * (14.185 + 7.093) * GIB / (450e9 * 0.70)
    adam = 7.093 * GIB / 2 / 4 * 28 / (3350e9 * 0.50)
    # optimizer_offload: Adam's two fp32 moments of the rank's quarter (7.093 GiB / 2 bytes x 8 bytes / 4) to the
    # host and back once a step over PCIe 5.0 (64 GB/s) at 70 %; grad_offload frees its buffers, moving nothing
    offload = 2 * (7.093 * GIB / 2 * 8 / 4) / (64e9 * 0.70)
    # TP2's activation all-reduces: a DP rank's 2,048 x 3,072 / 4 tokens x hidden 3,584 in bf16, two per layer (28)
    # in a forward, a ring moving 2 x 1/2 of them over NVLink at 70 %; the update: forward, recompute, backward; at
    # the model's ends one more of the same size in a forward (the vocabulary-parallel embedding's output) and in a
    # backward (the output layer's input gradient)
    tp_ring = (2048 * 3072 / 4 * 3584 * 2) / (450e9 * 0.70)
    tp_forward = 2 * 28 * tp_ring
    assert step.phase(Phase.UPDATE_ACTOR) == pytest.approx(
        compute + 3 * tp_forward + 2 * tp_ring + 4 * (ring + adam) + offload, rel=1e-6)
    no_offload = plan_from_sources(QWEN_7B, ["actor_rollout_ref.actor.megatron.optimizer_offload=false"])
    assert predict_step_time(no_offload, H100).phase(Phase.UPDATE_ACTOR) == pytest.approx(
        compute + 3 * tp_forward + 2 * tp_ring + 4 * (ring + adam), rel=1e-6)
    # the forward passes: no pipeline (PP1), 8 GPUs at 45 %, TP2's all-reduces once (and the embedding's); the
    # reference's weights (its 7.093 GiB a rank) wait on the host between its passes: back before it and out after,
    # over PCIe 5.0 at 70 %
    assert step.phase(Phase.OLD_LOG_PROB) == pytest.approx(
        flops[Phase.OLD_LOG_PROB] / 8 / (989e12 * 0.45) + tp_forward + tp_ring, rel=1e-6)
    assert step.phase(Phase.REF) == pytest.approx(
        flops[Phase.REF] / 8 / (989e12 * 0.45) + tp_forward + tp_ring + 2 * 7.093 * GIB / (64e9 * 0.70), rel=1e-6)
    # generation on one TP2 replica: 512 sequences; the prefill of the 1024-token prompt once per group of 8 at
    # 50 %; the KV cache (40.907 GiB a rank) holds 1,531,947 tokens = 498 sequences of 3072 at once: two waves of
    # 2048 decode steps, each reading the rank's 7.093 GiB of weights and the 498 sequences' cache at half length
    # (1024 + 1024 tokens x 28,672 bytes a token on a TP2 rank) at 70 % of 3350 GB/s
    prefill = forward_flops(plan.model, rows=512, layer_tokens=1024 / 8, head_tokens=0, seq_len=1024,
                            vocab_head=True) / 2 / (989e12 * 0.50)
    decode_step = (7.093 * GIB + 498 * 2048 * 28672) / (3350e9 * 0.70)
    assert step.phase(Phase.GEN) == pytest.approx(prefill + 2 * 2048 * decode_step, rel=1e-6)
    # the sync: TP2 -> TP2 moves nothing between ranks; each rank copies its 7.6 GB shard twice (the resharder
    # assembles it, vLLM copies it into its weights; each a read and a write) at 50 %, and both sides digest it,
    # CUDA's digest reading ~7 bytes a byte in a stream at 85 %; the probe, a
    # 16-token row, reads the trainer's 7.093 GiB a rank once and vLLM's as much (its matmuls are a few GFLOPs)
    shard = 7615820800
    probe = 2 * 7.093 * GIB / (3350e9 * 0.70)
    assert sum(probe_by_hand(plan)) == pytest.approx(probe, rel=1e-3)
    assert step.phase(Phase.SYNC) == pytest.approx(
        2 * 2 * shard / (3350e9 * 0.50) + 2 * 7 * shard / (3350e9 * 0.85) + probe, rel=1e-3)
    # colocated and synchronous: the phases one after another
    assert step.seconds == pytest.approx(sum(p.seconds for p in step.phases)) and not step.overlapped
    assert {p.phase: p.bound for p in step.phases}[Phase.GEN] == "memory (decode)"


def test_the_probes_length_is_the_workers_probe():
    from hybridrl.workers.probe import RARE_TOKEN_PROBE

    assert PROBE_TOKENS == len(RARE_TOKEN_PROBE.tokens) == 16


def probe_by_hand(plan) -> tuple[float, float]:
    """The sync's probe on the H100 description (no fixed costs, no latency): a 16-token row through the trainer and
    through vLLM, each side the slower of reading its weights (the trainer's rank reads its stage's once per stage,
    PP times) at 70 % of 3,350 GB/s and its matmuls (over its TP ranks) at 45 % (trainer) or 50 % (vLLM) of the
    dtype's peak: (the trainer's seconds, vLLM's)."""
    actor = next(m for m in plan.training_memory if m.role == "actor")
    mesh = plan.layout("actor").mesh
    infer_tp = plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size
    flops = forward_flops(plan.model, rows=1, layer_tokens=16, head_tokens=16, seq_len=16, vocab_head=True)
    trainer = max(actor.params_gib * GIB * mesh.pp / (3350e9 * 0.70),
                  flops / mesh.tp / (H100.peak_flops(plan.resolved.train_dtype) * 0.45))
    vllm = max(plan.rollout_memory.weights_gib * GIB / (3350e9 * 0.70),
               flops / infer_tp / (H100.peak_flops(plan.resolved.rollout_dtype) * 0.50))
    return trainer, vllm


def test_a_step_is_predicted_at_its_own_lengths():
    """The trainer compares each step with the prediction at the step's own lengths (`StepLengths`, from its
    metrics): the full lengths give the plan's prediction; shorter rows give the roofline of their own tokens."""
    plan = plan_from_sources(QWEN_7B, ["actor_rollout_ref.actor.megatron.optimizer_offload=false"])
    full = predict_step_time(plan, H100)
    at_full = predict_step_time(plan, H100, lengths=StepLengths(1024, 2048, 2048))
    assert [(p.phase, p.bound) for p in at_full.phases] == [(p.phase, p.bound) for p in full.phases]
    for mine, planned in zip(at_full.phases, full.phases, strict=True):
        assert mine.seconds == pytest.approx(planned.seconds, rel=1e-9), mine.phase
    # rows of 300 prompt and 500 response tokens, a fifth of a training pass's columns padding: the update's matmuls
    # (3 forwards + 1 recomputed) cover 1,000 computed columns a row in every decoder layer and the 500 response
    # tokens in the output layer, at the rows' mean length 800; TP2's all-reduces (28 layers' two a pass, and the
    # embedding's and the output layer's one each) move those 1,000 columns; the optimizer's terms do not depend on
    # lengths
    short = StepLengths(prompt_tokens=300, response_tokens=500, longest_response=1500, padding_ratio=0.2)
    step = predict_step_time(plan, H100, lengths=short)
    shape = plan.model
    rows = 2048
    update_flops = 3 * rows * (1000 * decoder_flops_per_token(shape, 800) + 500 * 2 * shape.hidden_size
                               * shape.vocab_size)
    tp = lambda columns: (3 * 2 * 28 + 2) * (rows * columns / 4 * 3584 * 2) / (450e9 * 0.70)  # noqa: E731
    fixed = full.phase(Phase.UPDATE_ACTOR) - (dict(plan.step_flops)[Phase.UPDATE_ACTOR] * 4 / 3 / 8 / (989e12 * 0.40)
                                              + tp(3072))
    assert step.phase(Phase.UPDATE_ACTOR) == pytest.approx(
        update_flops * 4 / 3 / 8 / (989e12 * 0.40) + tp(1000) + fixed, rel=1e-6)
    # generation: the prefill of 300-token prompts; 1,500 decode steps (the longest response), the 512 sequences
    # decoding together (800-token rows fit the KV cache's 1,531,947 tokens at once): each step reads the weights
    # and the cache at 300 + 250 tokens, or computes one token of each row, whichever is slower (here the matmuls)
    prefill = forward_flops(shape, rows=512, layer_tokens=300 / 8, head_tokens=0, seq_len=300,
                            vocab_head=True) / 2 / (989e12 * 0.50)
    assert plan.rollout_memory.kv_cache_tokens // 800 >= 512
    step_bytes = (7.093 * GIB + 512 * 550 * 28672) / (3350e9 * 0.70)
    step_flops = forward_flops(shape, rows=512, layer_tokens=1, head_tokens=1, seq_len=800,
                               vocab_head=True) / 2 / (989e12 * 0.50)
    assert step_flops > step_bytes
    assert step.phase(Phase.GEN) == pytest.approx(prefill + 1500 * step_flops, rel=1e-6)
    # vLLM admitting 128 sequences at a time: four waves; continuous batching refills a finished sequence's slot, so
    # three waves last a mean response (500) and the last the longest (1,500), at 128 rows' weights-and-cache reads
    narrow = plan_from_sources(QWEN_7B, ["actor_rollout_ref.actor.megatron.optimizer_offload=false",
                                         "actor_rollout_ref.rollout.max_num_seqs=128"])
    step_bytes = (7.093 * GIB + 128 * 550 * 28672) / (3350e9 * 0.70)
    step_flops = forward_flops(shape, rows=128, layer_tokens=1, head_tokens=1, seq_len=800,
                               vocab_head=True) / 2 / (989e12 * 0.50)
    assert step_bytes > step_flops
    assert predict_step_time(narrow, H100, lengths=short).phase(Phase.GEN) == pytest.approx(
        prefill + (3 * 500 + 1500) * step_bytes, rel=1e-6)
    # from a step's metrics; a step that did not log its lengths has none
    metrics = {"prompt_length/mean": 300.0, "response_length/mean": 500.0, "response_length/max": 1500.0,
               "perf/padding_ratio": 0.2}
    assert StepLengths.from_metrics(metrics) == short
    assert StepLengths.from_metrics({"response_length/mean": 500.0}) is None


def test_a_dp_group_across_machines_pays_the_network_and_async_modes_overlap_generation():
    # Llama-3-70B PPO on 16 x 8: the actor's DP groups (TP8 x PP4 -> DP4) span 32 consecutive ranks, four machines:
    # its gradient reduction runs at the network's bandwidth; a faster network shortens the update by exactly the
    # ring's bytes over the difference (4 optimizer steps x 3/4 x (grads + params) for the distributed optimizer)
    plan = plan_from_sources(LLAMA_70B)
    actor = next(m for m in plan.training_memory if m.role == "actor")
    fast = Hardware(**{**H100.__dict__, "name": "fast network", "inter_node_gb_per_s": 400})
    steps = plan.update("actor").optimizer_steps_per_step
    distributed = plan.layout("actor").megatron.use_distributed_optimizer
    ring_bytes = 0.75 * ((actor.grads_gib + actor.params_gib) if distributed else 2 * actor.grads_gib) * GIB
    # and its pipeline (PP4: a stage is 32 ranks, four machines) sends each DP rank's 512 x 2,048 / 4 tokens x hidden
    # 8,192 in bf16, split over TP8 by sequence parallelism, forward and back, across the network
    p2p_bytes = 2 * (512 * 2048 / 4 * 8192 * 2 / 8)
    saved = (steps * ring_bytes + p2p_bytes) * (1 / (50e9 * 0.7) - 1 / (400e9 * 0.7))
    slow_time = predict_step_time(plan, H100).phase(Phase.UPDATE_ACTOR)
    assert slow_time - predict_step_time(plan, fast).phase(Phase.UPDATE_ACTOR) == pytest.approx(saved, rel=1e-6)
    # the 7B's DP groups stay inside a machine: the network does not matter to it
    seven = plan_from_sources(QWEN_7B)
    assert predict_step_time(seven, fast).seconds == pytest.approx(predict_step_time(seven, H100).seconds)
    # a disaggregated one_step_off run: generation runs beside training, the step is the longer of the two
    disaggregated = plan_from_sources(QWEN_7B, [
        "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.mode=disaggregated",
        "actor_rollout_ref.rollout.n_gpus_per_node=4", "actor_rollout_ref.rollout.async_mode=one_step_off"])
    step = predict_step_time(disaggregated, H100)
    generation = step.phase(Phase.GEN)
    rest = sum(p.seconds for p in step.phases) - generation
    assert step.overlapped and step.seconds == pytest.approx(max(generation, rest))
    # the cross-pool sync: a training rank's even share of the sync's bytes over the network at 70 %; each rollout
    # rank copies its whole shard twice (assembled, then into vLLM; read + write at 50 %) and both sides digest it
    # (CUDA's ~7 bytes a byte, in a stream at 85 %), bucket by bucket (512 MiB): the trainer scores the probe while
    # the last bucket is written; then vLLM scores it
    share = disaggregated.reshard.cross_pool.bytes_sent_even
    shard = max(disaggregated.reshard.cross_pool.bytes_received)
    written = 2 * 2 * shard / (3350e9 * 0.50) + 2 * 7 * shard / (3350e9 * 0.85)
    buckets = -(-shard // (512 << 20))
    assert buckets == 15  # a 7.6 GB shard
    trainer, vllm = probe_by_hand(disaggregated)
    overlapped = max(trainer, written / buckets)
    assert step.phase(Phase.SYNC) == pytest.approx(
        share / (50e9 * 0.70) + written * (buckets - 1) / buckets + overlapped + vllm, rel=1e-6)


def test_an_moe_models_token_dispatch_over_ep_is_timed_by_hand():
    """NeMo-RL's Qwen3-30B-A3B job (bench/published/: TP1 PP1, EP8 inside a machine of 8, DP32): each rank's
    2,048 x 4,096 / 32 tokens go to their 8 experts and back in every one of the 48 MoE layers, two all-to-alls a
    forward, each sending 7/8 of tokens x 8 x hidden 2,048 in bf16 over NVLink at 70 %; nothing else of the model's
    parallelism moves (TP1, PP1). A forward-only pass pays it once, an update's forward and backward twice; a dense
    model nothing."""
    from hybridrl.config.step_time import activation_traffic_seconds

    plan = plan_from_sources(ROOT / "bench/published/nemo_qwen3_30b_a3b_grpo_4x8.yaml")
    layout = plan.layout("actor")
    tokens = 2048 * 4096 / 32
    per_pass = 2 * 48 * (7 / 8 * tokens * 8 * 2048 * 2) / (450e9 * 0.70)
    assert activation_traffic_seconds(plan, layout, 1, 1, H100) == pytest.approx(per_pass, rel=1e-9)
    assert activation_traffic_seconds(plan, layout, 2, 2, H100) == pytest.approx(2 * per_pass, rel=1e-9)
    # a dense model pays its TP2 all-reduces alone (the 7B example: as in the first test)
    # (two a layer and the embedding's one)
    dense = plan_from_sources(QWEN_7B)
    tp_forward = (2 * 28 + 1) * (2048 * 3072 / 4 * 3584 * 2) / (450e9 * 0.70)
    assert activation_traffic_seconds(dense, dense.layout("actor"), 1, 1, H100) == pytest.approx(tp_forward, rel=1e-9)


def test_a_sync_of_served_adapters_moves_the_adapter_alone():
    """lora.merge=false on the 7B example (rank 32 on every target): a step's sync is the PEFT adapter, not the
    weights. Per layer (hidden 3,584, FFN 18,944, q 3,584 and k/v 512 rows) the PEFT form holds q, k and v each an
    A of 32 x 3,584 and a B of rows x 32, o an A and a B of 32 x 3,584, gate and up an A of 32 x 3,584 and a B of
    18,944 x 32 each, down an A of 32 x 18,944 and a B of 3,584 x 32: 2,883,584 fp32 elements, x 28 layers x 4 B.
    Colocated on one machine every rank receives it over NVLink at 70 %; both sides digest it (CUDA's digest reads
    ~7 B a byte, in a stream at 85 % of 3,350 GB/s); the probe: one short row through the trainer and through vLLM
    (0 fixed costs on the H100 description). Disaggregated (trainer 4 ranks, rollout 4 ranks): each training rank
    sends one rollout rank the adapter over the network at 70 % of 50 GB/s."""
    lora = ["actor_rollout_ref.model.lora.rank=32", "actor_rollout_ref.model.lora.merge=false"]
    adapter = (3 * 32 * 3584 + 32 * (3584 + 512 + 512) + 2 * 32 * 3584 + 2 * (32 * 3584 + 18944 * 32)
               + 32 * 18944 + 3584 * 32) * 28 * 4
    assert adapter == 2_883_584 * 28 * 4
    digests = 2 * adapter * 7 / (3350e9 * 0.85)
    plan = plan_from_sources(QWEN_7B, lora)
    assert predict_step_time(plan, H100).phase(Phase.SYNC) == pytest.approx(
        adapter / (450e9 * 0.70) + digests + sum(probe_by_hand(plan)), rel=1e-6)
    apart = plan_from_sources(QWEN_7B, [*lora, "trainer.n_gpus_per_node=4",
                                        "actor_rollout_ref.rollout.mode=disaggregated",
                                        "actor_rollout_ref.rollout.n_gpus_per_node=4"])
    # (the trainer scores the probe while the rollout ranks digest the adapter; then vLLM scores it)
    trainer, vllm = probe_by_hand(apart)
    assert predict_step_time(apart, H100).phase(Phase.SYNC) == pytest.approx(
        adapter / (50e9 * 0.70) + max(trainer, digests) + vllm, rel=1e-6)


def test_a_lora_update_computes_no_weight_gradient_of_the_base_and_steps_the_adapters_alone():
    """LoRA rank 32 (type lora, every target) on the 7B example (sequence parallelism off: TP2's activation
    all-reduces then as in the whole model's test above). megatron's frozen layers compute their input's gradient
    only (`linear_with_frozen_weight`), so the update is 2 forwards of the base's weights, 3 of attention's QK^T and
    AV (2 x 3,072 x 3,584 FLOPs a token a layer at these lengths: the causal half, which the GPU's local spec
    computes with PyTorch's fused attention as TE's does) and 3 of the adapters (2 FLOPs an element a token; per
    layer: qkv A 32 x 3,584 + B 4,608 x 32, proj A 32 x 3,584 + B 3,584 x 32, fc1 A 32 x 3,584 + B 37,888 x 32, fc2
    A 32 x 18,944 + B 3,584 x 32); the recomputed forward adds a forward. Per optimizer step (4) the distributed
    optimizer reduce-scatters the adapters' fp32 gradients and all-gathers the fp32 adapters (a TP2 rank's: qkv A
    whole + B half, proj A half + B whole, fc1 A whole + B half, fc2 A half + B whole), and Adam steps the rank's
    quarter of them; optimizer_offload moves their moments, 8 bytes an element, over a quarter."""
    lora = ["actor_rollout_ref.model.lora.rank=32", "actor_rollout_ref.model.lora.alpha=64",
            "actor_rollout_ref.actor.megatron.sequence_parallel=false"]
    plan = plan_from_sources(QWEN_7B, lora)
    full = plan_from_sources(QWEN_7B, lora[2:])
    flops, whole = dict(plan.step_flops), dict(full.step_flops)
    base = whole[Phase.OLD_LOG_PROB]  # the same rows through the base's weights
    assert whole[Phase.UPDATE_ACTOR] == pytest.approx(3 * base, rel=1e-9)
    tokens = 2048 * 3072
    attention = tokens * 28 * 2 * 3072 * 3584
    per_layer = 32 * 3584 + 4608 * 32 + 32 * 3584 + 3584 * 32 + 32 * 3584 + 37888 * 32 + 32 * 18944 + 3584 * 32
    adapters = tokens * 2 * 28 * per_layer
    # the old log-probs: the adapters on top; the reference: the base alone (adapters off)
    assert flops[Phase.OLD_LOG_PROB] == pytest.approx(base + adapters, rel=1e-9)
    assert flops[Phase.REF] == pytest.approx(base, rel=1e-9)
    update = 2 * base + attention + 3 * adapters
    assert flops[Phase.UPDATE_ACTOR] == pytest.approx(update, rel=1e-9)
    assert update < 0.8 * whole[Phase.UPDATE_ACTOR]
    rank_elements = 28 * (32 * 3584 + 2304 * 32 + 32 * 1792 + 3584 * 32 + 32 * 3584 + 18944 * 32 + 32 * 9472
                          + 3584 * 32)
    actor = next(m for m in plan.training_memory if m.role == "actor")
    assert actor.grads_gib == pytest.approx(rank_elements * 4 / GIB, abs=5e-4)
    grads = actor.grads_gib * GIB  # as the plan rounded it
    compute = (update + base + adapters) / 8 / (989e12 * 0.40)
    ring = 0.75 * 2 * grads / (450e9 * 0.70)
    adam = grads / 4 / 4 * 28 / (3350e9 * 0.50)
    offload = 2 * (grads / 4 * 8 / 4) / (64e9 * 0.70)
    tp_ring = (2048 * 3072 / 4 * 3584 * 2) / (450e9 * 0.70)
    tp_forward = 2 * 28 * tp_ring
    assert predict_step_time(plan, H100).phase(Phase.UPDATE_ACTOR) == pytest.approx(
        compute + 3 * tp_forward + 2 * tp_ring + 4 * (ring + adam) + offload, rel=1e-6)


def test_the_plan_prints_the_prediction_only_when_asked_and_refuses_unknown_hardware(tmp_path):
    text = render_plan(plan_from_sources(QWEN_7B, ["trainer.hardware=h200"]))
    line = next(line for line in text.splitlines() if line.startswith("Predicted step time"))
    assert "on h200" in line and "gen " in line and "update_actor " in line
    assert "Predicted step time" not in render_plan(plan_from_sources(QWEN_7B))
    # a user's own description: a YAML file of the same fields
    own = tmp_path / "my-gpu.yaml"
    own.write_text("bf16_tflops: 500\nfp32_tflops: 40\nmemory_gb_per_s: 2000\nintra_node_gb_per_s: 200\n"
                   "inter_node_gb_per_s: 12.5\nhost_gb_per_s: 32\n")
    assert load_hardware(str(own)) == Hardware("my-gpu", 500, 40, 2000, 200, 12.5, 32)
    assert "on my-gpu" in render_plan(plan_from_sources(QWEN_7B, [f"trainer.hardware={own}"]))
    # mistakes: an unknown name, a file missing a field or holding a non-number, each naming the field and value
    broken = tmp_path / "broken.yaml"
    broken.write_text("bf16_tflops: fast\nfp32_tflops: 40\nmemory_gb_per_s: 2000\nintra_node_gb_per_s: 200\n")
    for value, words in (("h1000", "neither a shipped hardware name (a100-80gb, h100-sxm, h200, b200)"),
                         (str(broken), "missing inter_node_gb_per_s, host_gb_per_s; not a finite number > 0: "
                                       "bf16_tflops='fast'")):
        with pytest.raises(ConfigError) as info:
            plan_from_sources(QWEN_7B, [f"trainer.hardware={value}"])
        assert [(i.field, i.value) for i in info.value.issues] == [("trainer.hardware", value)]
        assert words in info.value.issues[0].rule, info.value.issues[0].rule
    with pytest.raises(HardwareError):
        load_hardware(str(tmp_path / "absent.yaml"))
    # the CLI: exit 2 and the field, no traceback
    result = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", QWEN_7B, "trainer.hardware=h1000",
                             "--layout-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "trainer.hardware" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(("line", "words"), [
    ("memory_gb_per_s: .inf", "not a finite number > 0: memory_gb_per_s=inf"),
    ("memory_gb_per_s: .nan", "not a finite number > 0: memory_gb_per_s=nan"),
    ("memory_gb_per_s: 3350\nlink_latency_us: .inf", "not a finite number >= 0: link_latency_us=inf"),
    ("memory_gb_per_s: 3350\nefficiency: {decode_memory: 70}",
     "above 4: efficiency.decode_memory=70 (an efficiency is a fraction of the figure it scales: 0.7 for 70 %)"),
    ("memory_gb_per_s: 3350\nname: [h100]", "not a name (text): name=['h100']"),
])
def test_a_description_that_would_predict_nonsense_is_refused_naming_the_field(tmp_path, line, words):
    """An infinite figure made a phase take 0 s or inf s (`inf s: ... (nan%)`), a percent written for an efficiency
    70x the HBM bandwidth; each is refused at plan time, naming the field and the value."""
    own = tmp_path / "my-gpu.yaml"
    own.write_text("bf16_tflops: 989\nfp32_tflops: 67\nintra_node_gb_per_s: 450\ninter_node_gb_per_s: 50\n"
                   f"host_gb_per_s: 64\n{line}\n")
    with pytest.raises(ConfigError) as info:
        plan_from_sources(QWEN_7B, [f"trainer.hardware={own}"])
    assert [(i.field, i.value) for i in info.value.issues] == [("trainer.hardware", str(own))]
    assert words in info.value.issues[0].rule, info.value.issues[0].rule
    # the measured CPU description's efficiencies above 1 (1.724: its matmuls outrun the 512 x 512 benchmark) stay
    assert load_hardware(str(ROOT / "configs/hardware/this-cpu-2-ranks.yaml")).efficiency.update_matmul == 1.724


def test_the_efficiencies_are_the_documented_ones():
    """A change to a stated efficiency must be a decision, seen here and in docs/performance.md."""
    assert (EFFICIENCY.update_matmul, EFFICIENCY.forward_matmul, EFFICIENCY.prefill_matmul, EFFICIENCY.decode_memory,
            EFFICIENCY.link, EFFICIENCY.optimizer_memory, EFFICIENCY.stream_memory) == (
        0.40, 0.45, 0.50, 0.70, 0.70, 0.50, 0.85)
    doc = (ROOT / "docs/performance.md").read_text()
    for name, value in EFFICIENCY.__dict__.items():
        assert f"`{name}` {value:.2f}" in doc, name


def test_the_documented_predictions_are_the_plans():
    doc = (ROOT / "docs/performance.md").read_text()
    rows = [line for line in doc.split("## Predicted step time", 1)[1].splitlines() if line.startswith("| `")]
    assert len(rows) == 4
    for row in rows:
        name, *overrides = row.split("`")[1].split()
        step = predict_step_time(plan_from_sources(str(ROOT / "configs/examples" / name), overrides), H100)
        assert f"| {step.seconds:.3g} s |" in row, (row, step.seconds)
        assert f"| {step.phase(Phase.GEN):.3g} s" in row, (row, step.phase(Phase.GEN))
        updates = step.phase(Phase.UPDATE_ACTOR) + step.phase(Phase.UPDATE_CRITIC)
        assert f"| {updates:.3g} s |" in row, (row, updates)
        passes = sum(step.phase(phase) for phase in set(PASS_PHASES.values()))
        assert f"| {passes:.3g} s |" in row, (row, passes)
        assert row.endswith(f"| {step.phase(Phase.SYNC) * 1e3:.3g} ms |"), (row, step.phase(Phase.SYNC))


def test_measured_over_predicted_is_each_timed_phase_over_the_plans():
    step = StepTime("h100-sxm", (PhaseTime(Phase.GEN, 2.0, "memory (decode)"), PhaseTime(Phase.UPDATE_ACTOR, 4.0,
                                                                                        "matmul")), overlapped=False)
    measured = {"timing_s/gen": 3.0, "timing_s/update_actor": 2.0, "timing_s/reward": 0.5, "timing_s/step": 9.0}
    assert time_vs_plan(step, measured) == {"time_vs_plan/gen": 1.5, "time_vs_plan/update_actor": 0.5,
                                            "time_vs_plan/step": 1.5}
    assert time_vs_plan(step, {"timing_s/gen": 1.0}) == {"time_vs_plan/gen": 0.5}  # a phase not timed: left out


def test_hardware_measure_refuses_an_unwritable_out_before_measuring(tmp_path):
    """`--out afile/x.yaml` (afile a file) or a folder: refused naming --out and the file, exit 2, before the
    measurement (which took a minute and then died with NotADirectoryError): nothing measured, nothing written."""
    import time

    (tmp_path / "afile").write_text("a file")
    (tmp_path / "dir.yaml").mkdir()
    for out, words in ((tmp_path / "afile" / "x.yaml", f"{tmp_path / 'afile'} is a file, not a folder"),
                       (tmp_path / "afile" / "deeper" / "x.yaml", f"{tmp_path / 'afile'} is a file, not a folder"),
                       (tmp_path / "dir.yaml", "is a folder")):
        started = time.perf_counter()
        refused = subprocess.run([sys.executable, "-m", "hybridrl.cli", "hardware", "--measure", "--ranks", "2",
                                  "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert f"--out={out}" in refused.stderr and words in refused.stderr and "Traceback" not in refused.stderr
        assert refused.stdout == "" and time.perf_counter() - started < 30  # the measured text is printed first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir.yaml"]


def test_hybridrl_hardware_lists_the_shipped_gpus_and_measures_this_machine_as_a_cpu_ranks_description(tmp_path):
    """`hybridrl hardware --measure` against figures timed here with plain torch (one thread, as one of two ranks on
    this 2-core machine gets): its fp32 matmul and memory figures within 3x of these (a shared machine's noise), and
    its YAML read back by the plan's loader."""
    import time

    import torch

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hybridrl.cli", "hardware", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    listed = cli()
    assert listed.returncode == 0 and all(name in listed.stdout for name in SHIPPED)
    for args, words in ((("--out", "x.yaml"), "add --measure"), (("--measure", "--ranks", "0"), "--ranks=0"),
                        (("--measure", "--out", "x.txt"), "--out=x.txt (a .yaml file")):
        refused = cli(*args)
        assert refused.returncode == 2 and words in refused.stderr and "Traceback" not in refused.stderr
    out = tmp_path / "new-folder" / "this-cpu.yaml"  # its folder is made
    measured = cli("--measure", "--ranks", "2", "--repeats", "3", "--out", str(out))
    assert measured.returncode == 0, measured.stderr[-2000:]
    hardware = load_hardware(str(out))
    assert hardware.name.endswith("1 of 2 rank(s)") and hardware.host_gb_per_s == hardware.memory_gb_per_s
    # the link and a streaming read run at the measured rates; the other efficiencies stay the stated ones
    assert (hardware.efficiency.link, hardware.efficiency.stream_memory) == (1.0, 1.0)
    assert hardware.efficiency.update_matmul == EFFICIENCY.update_matmul

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0)) // 2))
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        source = torch.ones(256 * 2**20, dtype=torch.uint8)
        target = torch.empty_like(source)

        def best(work) -> float:
            work()
            times = []
            for _ in range(3):
                started = time.perf_counter()
                work()
                times.append(time.perf_counter() - started)
            return min(times)

        fp32_tflops = 2 * 512**3 / best(lambda: torch.mm(a, b)) / 1e12
        memory_gb_per_s = 2 * source.numel() / best(lambda: target.copy_(source)) / 1e9
    finally:
        torch.set_num_threads(threads)
    assert fp32_tflops / 3 <= hardware.fp32_tflops <= fp32_tflops * 3, (hardware.fp32_tflops, fp32_tflops)
    assert memory_gb_per_s / 3 <= hardware.memory_gb_per_s <= memory_gb_per_s * 3, (hardware, memory_gb_per_s)
    assert hardware.intra_node_gb_per_s > 0 and hardware.intra_node_gb_per_s == hardware.inter_node_gb_per_s
    # an all-reduce of 8 floats costs something, and less than moving the bandwidth figure's 64 MiB
    assert 0 < hardware.link_latency_us * 1e-6 < 64 * 2**20 / (hardware.intra_node_gb_per_s * 1e9), hardware
    # the shipped description of this machine (written by the same command) plans a CPU job's time
    shipped = str(ROOT / "configs/hardware/this-cpu-2-ranks.yaml")
    tiny = ROOT / "configs/models/tiny-demo"
    plan = plan_from_sources(str(ROOT / "configs/examples/cpu_tiny_grpo.yaml"),
                             [f"trainer.hardware={shipped}", f"actor_rollout_ref.model.path={tiny}"])
    assert predict_step_time(plan, load_hardware(shipped)).seconds > 0


def test_the_documented_published_rows_are_the_models():
    """docs/performance.md's NeMo-RL rows: each predicted step is what bench/published_rows.py's job and lengths give
    now, and the published figure beside it is the bench's (a change to the model shows here)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import published_rows

    doc = (ROOT / "docs/performance.md").read_text().split("### Against published GPU results", 1)[1]
    lines = [line for line in doc.split("###", 1)[0].splitlines() if line.startswith("| ") and " GRPO" in line]
    rows = [row for row in published_rows.ROWS if row.g_avg_seq is not None]
    assert len(lines) == len(rows) == 6
    for line, row in zip(lines, rows, strict=True):
        plan = published_rows.plan_row(row)
        predicted = published_rows.evaluate(row, plan, EFFICIENCY)
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[1] == str(plan.resolved.total_ranks), (line, plan.resolved.total_ranks)
        assert cells[2] == f"{row.published_step_s:g} s", line
        assert cells[3] == f"{predicted['step_s']:.3g} s", (line, predicted["step_s"])
        assert abs(float(cells[4].split()[0]) - 100 * predicted["error"]) < 0.051, (line, predicted["error"])


def test_a_descriptions_fixed_costs_and_efficiencies_add_what_they_say(tmp_path):
    """A description's fixed costs (a decode step, a decoder layer's pass over a micro-batch) and its own efficiencies
    (a measured description's sustained rates) change each phase by what is written out here."""
    plan = plan_from_sources(QWEN_7B, ["actor_rollout_ref.actor.megatron.optimizer_offload=false"])
    base = predict_step_time(plan, H100)
    own = tmp_path / "h100-with-costs.yaml"
    own.write_text("bf16_tflops: 989\nfp32_tflops: 67\nmemory_gb_per_s: 3350\nintra_node_gb_per_s: 450\n"
                   "inter_node_gb_per_s: 50\nhost_gb_per_s: 64\ndecode_step_ms: 2\nlayer_pass_ms: 0.5\n"
                   "sync_tensor_ms: 0.1\nefficiency:\n  update_matmul: 0.8\n")
    hardware = load_hardware(str(own))
    assert (hardware.decode_step_ms, hardware.layer_pass_ms, hardware.efficiency.update_matmul,
            hardware.efficiency.forward_matmul) == (2.0, 0.5, 0.8, 0.45)
    step = predict_step_time(plan, hardware)
    # generation: two waves of 2,048 decode steps and a prefill call each, 2 ms apiece
    assert step.phase(Phase.GEN) - base.phase(Phase.GEN) == pytest.approx((2 * 2048 + 2) * 2e-3)
    # the reference pass: a rank's 2,048 / 4 = 512 rows in micro-batches of 16 = 32 passes of 28 layers, 0.5 ms each
    assert step.phase(Phase.REF) - base.phase(Phase.REF) == pytest.approx(32 * 28 * 0.5e-3)
    # the update: its matmul term at twice the efficiency (0.8 for 0.4), plus 4 optimizer steps x 128 / 4 = 32
    # micro-batches x (forward, backward = 2, recomputed forward) passes of 28 layers at 0.5 ms
    matmuls = dict(plan.step_flops)[Phase.UPDATE_ACTOR] * 4 / 3 / 8 / (989e12 * 0.40)
    assert step.phase(Phase.UPDATE_ACTOR) - base.phase(Phase.UPDATE_ACTOR) == pytest.approx(
        -matmuls / 2 + 4 * 32 * 4 * 28 * 0.5e-3, rel=1e-6)
    # the sync: its probe, one row through the actor's 28 layers and one vLLM step; and the tensors it writes into
    # each vLLM rank, 0.1 ms each: 28 layers of 7 (q/k/v fused, their biases fused, o, gate/up fused, down, two
    # norms), the embedding, the final norm and the (untied) LM head
    assert synced_tensors(plan.model) == 28 * 7 + 3
    assert step.phase(Phase.SYNC) - base.phase(Phase.SYNC) == pytest.approx(28 * 0.5e-3 + 2e-3 + 199 * 0.1e-3)
    # a link latency of 10 us: TP2's two all-reduces a layer (28) in each pass over a micro-batch, each a ring of
    # 2 (2 - 1) steps, and at the model's ends the embedding's and the log-probs' three in a forward, the output
    # layer's in a backward: the reference's 32 micro-batches once; the update's 4 x 32 forward, backward and
    # recompute; and per optimizer step (4) megatron's DDP buckets of 40M parameters (3.808B a rank: 96) in rings of
    # 2 (4 - 1) steps over DP4; the sync's probe, one forward of one row, and its two object all-gathers over the 8
    # ranks (the log-probs, the replicas' gaps), each two all-gathers of 7 steps
    slow = tmp_path / "h100-latency.yaml"
    slow.write_text(own.read_text() + "link_latency_us: 10\n")
    step_latency = predict_step_time(plan, load_hardware(str(slow)))
    assert step_latency.phase(Phase.REF) - step.phase(Phase.REF) == pytest.approx((2 * 28 + 4) * 32 * 2 * 10e-6)
    assert step_latency.phase(Phase.UPDATE_ACTOR) - step.phase(Phase.UPDATE_ACTOR) == pytest.approx(
        (3 * 2 * 28 + 4 + 1) * 128 * 2 * 10e-6 + 4 * 96 * 2 * 3 * 10e-6)
    assert step_latency.phase(Phase.SYNC) - step.phase(Phase.SYNC) == pytest.approx(
        (2 * 28 + 4) * 2 * 10e-6 + 2 * 2 * 7 * 10e-6)
    # mistakes named: a negative fixed cost, an unknown efficiency
    bad = tmp_path / "bad.yaml"
    bad.write_text(own.read_text().replace("decode_step_ms: 2", "decode_step_ms: -1") + "  decode_speed: 1\n")
    with pytest.raises(HardwareError) as info:
        load_hardware(str(bad))
    assert "unknown field(s) efficiency.decode_speed" in str(info.value)
    assert "not a finite number >= 0: decode_step_ms=-1" in str(info.value)


def test_this_cpus_description_holds_the_benchs_fit_and_the_doc_its_table():
    """configs/hardware/this-cpu-2-ranks.yaml's fixed costs and efficiencies are bench/time_vs_plan.py's fit, and
    docs/performance.md's measured-against-predicted table is that bench's result."""
    import json

    result = json.loads((ROOT / "bench/results/time_vs_plan.json").read_text())
    hardware = load_hardware(str(ROOT / result["hardware"]))
    fitted = result["fitted"]
    assert (hardware.decode_step_ms, hardware.layer_pass_ms) == (fitted["decode_step_ms"], fitted["layer_pass_ms"])
    for name in ("update_matmul", "forward_matmul", "prefill_matmul", "decode_memory", "optimizer_memory"):
        assert getattr(hardware.efficiency, name) == fitted[name], name
    doc = (ROOT / "docs/performance.md").read_text()
    for run in result["runs"]:
        cells = ["-" if (f := run["phases"].get(phase)) is None else
                 f"{f['measured_s']:.3g} / {f['predicted_s']:.3g} s (x{f['measured_over_predicted']:.2f})"
                 for phase in ("gen", "update_actor", "sync", "step")]
        row = f"| {run['run']}{' (fitted)' if run['fitted_on'] else ''} | " + " | ".join(cells) + " |"
        assert row in doc, row


def test_an_async_jobs_printed_step_names_the_two_sides_it_is_the_longer_of():
    """One step ahead, the step is the longer of generation and the rest, not the phases' sum its shares are of: the
    line names both sides, summed here from the phases, and the step is the longer. It printed '353 s: gen 98.3 s
    (22%) ... update_actor 242 s (54%)' with nothing to say what 22 % and 54 % were of."""
    arr = "actor_rollout_ref.rollout"
    plan = plan_from_sources(QWEN_7B, ["trainer.hardware=h100-sxm", "trainer.n_gpus_per_node=4",
                                       f"{arr}.mode=disaggregated", f"{arr}.n_gpus_per_node=4",
                                       f"{arr}.async_mode=one_step_off"])
    step = predict_step_time(plan, H100)
    generation = sum(p.seconds for p in step.phases if p.phase == Phase.GEN)
    rest = sum(p.seconds for p in step.phases if p.phase != Phase.GEN)
    assert step.overlapped and generation < rest and step.seconds == pytest.approx(rest)
    line = next(line for line in render_plan(plan).splitlines() if line.startswith("Predicted step time"))
    assert (f"the longer of generation {seconds_text(generation)} and the rest {seconds_text(rest)}; shares of the "
            f"phases' {seconds_text(generation + rest)}): {seconds_text(step.seconds)}: gen ") in line, line
