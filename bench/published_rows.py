#!/usr/bin/env python
"""Published GPU step times of peer RL frameworks (NeMo-RL, verl), simulated with hybridrl's plan and step-time model.

Each published row becomes a hybridrl job (a YAML under bench/published/, plus overrides for its sibling row): the
row's layouts (generation TP, training TP/PP/EP, pool sizes), batch (prompts x generations, the optimizer's mini-batch),
length limits, micro-batching and memory settings, as near as hybridrl can express them; what it cannot is listed per
row (`differences`). `plan_from_sources` plans the job (every row plans: the layout checks and the memory check pass)
and `predict_step_time` predicts its step at the row's lengths (`StepLengths`):

- NeMo-RL (its performance summary, H100 = `h100-sxm`): G-avg seq, the mean prompt + response, is published; the mean
  prompt is taken as 150 tokens (OpenMathInstruct-2 problems in the chat template: an assumption), so the mean response
  is G-avg - 150, and the longest response is the limit (2,048 samples a step: some reach it). Error = predicted /
  published - 1, then the median absolute error over the NeMo rows.
- verl (its one-step-off and fully-async READMEs, H20: not a shipped hardware; `H20` below, NVIDIA's datasheet
  figures): no mean response length is published, so none is assumed. Reported instead: the mean response at which
  the prediction equals the published step (bisection on `StepLengths.response_tokens`, the longest response at the
  limit, the mean prompt 200 tokens: DAPO-Math-17k with DAPO's instruction, an assumption). That length is what the
  row reports; it is not an error. verl's fully-async rows (staleness, partial rollouts) are modelled only as
  "generation overlaps training" (the step = the longer of the two), which is all hybridrl's step model says of them.

Two efficiencies: the model's default `EFFICIENCY` (stated, not calibrated), and one calibrated on 1 of the 6 NeMo rows
(N5-1, dense and colocated): ONE multiplier on the training passes' matmul efficiencies (`update_matmul`,
`forward_matmul`; generation's stay: the generation-bound rows already agree), bisected so that the row's error is zero;
the other five rows are then predictions with it. Predicted tokens/s/GPU = samples x mean
(prompt + response) / predicted step / all GPUs (both pools), beside the published figure.

    python bench/published_rows.py     # prints every row and a table; writes bench/results/published_rows.json
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.config import ConfigError, Plan, plan_from_sources  # noqa: E402
from hybridrl.config.hardware import EFFICIENCY, SHIPPED, Efficiency, Hardware  # noqa: E402  # noqa: E402
from hybridrl.config.step_time import StepLengths, StepTime, predict_step_time  # noqa: E402

RESULT = ROOT / "bench" / "results" / "published_rows.json"
JOBS = "bench/published"

# NVIDIA H20 datasheet figures (dense): BF16 148 TFLOP/s, FP32 44 TFLOP/s, HBM3 4.0 TB/s, NVLink 900 GB/s both
# directions (450 one way), and, as for the shipped entries, a 400 Gb/s network port per GPU (50 GB/s) and PCIe 5.0
# x16 (64 GB/s a direction). Defined here only: hybridrl ships no H20 entry.
H20 = Hardware("h20", bf16_tflops=148, fp32_tflops=44, memory_gb_per_s=4000, intra_node_gb_per_s=450,
               inter_node_gb_per_s=50, host_gb_per_s=64)
HARDWARE = {"h100-sxm": SHIPPED["h100-sxm"], "h20": H20}

NEMO_PROMPT_TOKENS = 150  # OpenMathInstruct-2 problem in the chat template: assumed (not published)
DAPO_PROMPT_TOKENS = 200  # DAPO-Math-17k problem with DAPO's answer-format instruction: assumed (not published)
CALIBRATION_ROWS = ("N5-1",)
# the Efficiency fields the calibration scales: the training passes' matmul fractions. The generation-bound rows (the
# 1-step-off ones, whose step is their generation) come out within a few % at the stated decode efficiency; what the
# colocated rows add is the training passes, so those are what one dense row calibrates.
SCALED_FIELDS = ("update_matmul", "forward_matmul")
PHASES = ("gen", "old_log_prob", "ref", "update_actor", "sync")

NEMO_REPO = "NVIDIA-NeMo/RL"
NEMO_PATH = "docs/about/performance-summary.md"
NEMO_V05 = "9dbd9adc95a10f5946cceb36e1d5b31e2429e470"  # the v0.5 table (Llama-3.1-8B, Qwen3-32B rows)
NEMO_V06 = "aea463dd2dad3c9dd39d92df3a1616647c8ff45a"  # the v0.6 table (= snapshot 7ea279ab's file)
VERL_REPO = "volcengine/verl"
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"  # snapshot; the READMEs last changed at df340d70
ONE_STEP_OFF = "verl/experimental/one_step_off_policy/README.md"
FULLY_ASYNC = "verl/experimental/fully_async_policy/README.md"

A = "actor_rollout_ref"


def pool(nodes: int, per_node: int, train_nodes: int, mode: str) -> list[str]:
    """A disaggregated rollout pool of `nodes` x `per_node` GPUs beside a training pool of `train_nodes` machines."""
    return [f"{A}.rollout.mode=disaggregated", f"{A}.rollout.async_mode={mode}", f"{A}.rollout.nnodes={nodes}",
            f"{A}.rollout.n_gpus_per_node={per_node}", f"trainer.nnodes={train_nodes}"]


NEMO_OFF_POLICY = [f"{A}.rollout.gpu_memory_utilization=0.8", f"{A}.actor.megatron.grad_offload=false"]

NEMO_COMMON = [
    "mean prompt 150 tokens (assumed: OpenMathInstruct-2 problems in the chat template); the longest response is "
    "the limit, 3,584 (512 + 3,584 = NeMo's 4,096 total; NeMo caps prompt + response together, so its capped "
    "responses can run to 4,096 - prompt, ~3,946 tokens at 150)",
    "KL loss to a reference (k3, 0.01) assumed: the summary does not state it (grpo_math_1B's loss_fn, as quoted by "
    "third-party copies); NeMo swaps the reference's weights into the policy model, hybridrl runs a reference pass "
    "on the actor's layout (the same FLOPs)",
    "sequence packing at micro-batch 1 (train_mb_tokens 4,096) -> dynamic batching at 4,096 tokens a GPU",
    "generation: waves of the sequences the KV cache holds at once, every wave but the last a mean response long "
    "(continuous batching), the last the longest; vLLM's own scheduling (chunked prefill, preemption) not modelled",
    "not in the step model: reward scoring, advantages, data movement, logging; NeMo's step time includes them",
    "the precision-aware optimizer is accepted (override_optimizer_config) but the model's Adam pass reads 28 B/param",
]
NEMO_REFIT = [
    "NeMo's switch from training to generation is NeMo's own cost, not hybridrl's sync: NeMo-RL measured its colocated "
    "refit of Qwen3-30B-A3B at 13.1-17.2 s a step (B200, MXFP8; github.com/NVIDIA-NeMo/RL pull 3294) and ~20 s of a "
    "DeepSeek-V3 refit in offloading (pull 638); the model charges hybridrl's in-place sync (well under a second) "
    "and the PCIe copies of what it offloads",
]
NEMO_ASYNC = [
    "NeMo's async GRPO (max_trajectory_age_steps 1, in-flight weight updates, importance-sampling correction) is "
    "modelled as one_step_off: the step = the longer of generation (its own pool) and the rest (training pool)",
]
MOE = ["MoE: the EP all-to-all (token dispatch and combine) is in the step model at the link's bandwidth; the experts' "
       "grouped GEMMs (128 experts of FFN 768) are taken at the dense matmul efficiency, which small GEMMs do not "
       "reach; token-dropless as in NeMo (no capacity factor)"]
VERL_COMMON = [
    "H20 is not a shipped hardware: defined in this script from NVIDIA's datasheet (148 / 44 TFLOP/s, 4.0 TB/s HBM, "
    "450 GB/s NVLink a direction, 50 GB/s network, 64 GB/s PCIe)",
    "mean response length not published: the row reports the one at which the prediction equals the published step "
    "(mean prompt 200 tokens assumed: DAPO-Math-17k with DAPO's instruction; longest response 8,192)",
    "verl's rollout max_num_seqs 256 (its default at this commit): generation runs in ceil(sequences / 256) waves, "
    "each as long as the longest response in hybridrl's model (vLLM refills slots as sequences finish)",
    "not in the step model: the DAPO reward manager, advantages, data movement, vLLM wake-up/sleep",
]


@dataclass
class Row:
    id: str
    framework: str
    model: str
    mode: str
    source: dict[str, str]
    yaml: str
    overrides: list[str]
    hardware: str
    published_step_s: float
    published_phases_s: dict[str, float] = field(default_factory=dict)  # hybridrl's phase names, where comparable
    published_other_s: dict[str, float] = field(default_factory=dict)   # published phases with no model counterpart
    published_tokens_per_s_per_gpu: float | None = None
    g_avg_seq: float | None = None  # NeMo: mean prompt + response tokens
    prompt_tokens: float = NEMO_PROMPT_TOKENS
    batch_scale: float = 1.0  # published samples / the job's samples, where the job cannot hold the row's batch
    differences: list[str] = field(default_factory=list)


def nemo(table: str, commit: str) -> dict[str, str]:
    return {"repo": NEMO_REPO, "path": NEMO_PATH, "commit": commit, "table": table}


def verl(path: str, table: str) -> dict[str, str]:
    return {"repo": VERL_REPO, "path": path, "commit": VERL_COMMIT, "table": table}


LLAMA = f"{JOBS}/nemo_llama3.1_8b_grpo_2x8.yaml"
QWEN30 = f"{JOBS}/nemo_qwen3_30b_a3b_grpo_4x8.yaml"
QWEN32 = f"{JOBS}/nemo_qwen3_32b_grpo_4x8.yaml"
VERL7 = f"{JOBS}/verl_qwen2.5_7b_dapo_megatron_colocate_2x8.yaml"
VERL30 = f"{JOBS}/verl_qwen3_30b_a3b_grpo_megatron_colocate_16x8.yaml"
V30_LAYOUT = [
    "Megatron TP2 CP2 EP8 ETP1 in verl; hybridrl refuses CP > 1 on cuda and ETP != TP where TP > 1, and TP1 CP1 does "
    "not fit (activations of 10,240-token micro-batches without recompute: 125 GiB): TP2 + sequence parallelism, "
    "ETP2, CP1, EP8 here (each sequence on 2 GPUs, not 4; experts split 2 ways within EP)",
    "DeepEP 'flex' dispatcher, MoE fusions and optimizer_cpu_offload (Adam stepped on the CPU) are not in the step "
    "model; hybridrl's alltoall dispatcher and a GPU Adam pass, with offload copies over PCIe",
]

ROWS = (
    Row("N5-1", "NeMo-RL v0.5", "Llama-3.1-8B-Instruct", "on-policy, colocated, 16 GPUs",
        nemo("H100 BF16, GRPO LLAMA3.1_8B On", NEMO_V05), LLAMA, [], "h100-sxm", 92.8,
        published_tokens_per_s_per_gpu=1581, g_avg_seq=1019,
        differences=NEMO_COMMON + NEMO_REFIT + [
            "Megatron state (grads, Adam moments) leaves the GPU while vLLM generates (NeMo offloads before "
            "generation): modelled as PCIe copies",
            "defer_fp32_logits not modelled; activation checkpointing on (full recompute: 4/3 of the update's "
            "matmuls)"]),
    Row("N5-2", "NeMo-RL v0.5", "Llama-3.1-8B-Instruct", "1-step off, 8 generation + 8 training GPUs",
        nemo("H100 BF16, GRPO LLAMA3.1_8B 1-step Off", NEMO_V05), LLAMA,
        pool(1, 8, 1, "one_step_off") + NEMO_OFF_POLICY + [f"{A}.actor.megatron.pipeline_model_parallel_size=1"],
        "h100-sxm", 64.8, published_tokens_per_s_per_gpu=2478, g_avg_seq=1123,
        differences=NEMO_COMMON + NEMO_ASYNC + [
            "Adam's moments stay offloaded between updates (optimizer_offload): hybridrl's memory check puts the "
            "8-GPU TP1 PP1 trainer at 84.7 GiB without it (the reference pass's peak); NeMo's recipe does not say",
            "activation checkpointing on, as in the on-policy recipe (the async recipe's own setting not stated)"]),
    Row("N5-10", "NeMo-RL v0.5", "Qwen3-32B", "on-policy, colocated, 32 GPUs",
        nemo("H100 BF16, GRPO Qwen3-32B On", NEMO_V05), QWEN32, [], "h100-sxm", 376,
        published_tokens_per_s_per_gpu=571, g_avg_seq=3251,
        differences=NEMO_COMMON + NEMO_REFIT + [
            "Megatron state leaves the GPU while vLLM generates: modelled as PCIe copies",
            "sequence parallelism off (not stated; grpo_math_1B's default assumed)"]),
    Row("N5-11", "NeMo-RL v0.5", "Qwen3-32B", "1-step off, 32 generation + 32 training GPUs",
        nemo("H100 BF16, GRPO Qwen3-32B 1-step Off", NEMO_V05), QWEN32,
        pool(4, 8, 4, "one_step_off") + NEMO_OFF_POLICY + [f"{A}.actor.megatron.optimizer_offload=false"],
        "h100-sxm", 200, published_tokens_per_s_per_gpu=538, g_avg_seq=3252,
        differences=NEMO_COMMON + NEMO_ASYNC + ["sequence parallelism off (not stated)"]),
    Row("N6-7", "NeMo-RL v0.6", "Qwen3-30B-A3B", "on-policy, colocated, 32 GPUs",
        nemo("H100 BF16, GRPO Qwen3-30B3A On", NEMO_V06), QWEN30, [], "h100-sxm", 192,
        published_tokens_per_s_per_gpu=1102, g_avg_seq=3203,
        differences=NEMO_COMMON + NEMO_REFIT + MOE + [
            "Megatron state leaves the GPU while vLLM generates: PCIe copies"]),
    Row("N6-8", "NeMo-RL v0.6", "Qwen3-30B-A3B", "1-step off, 16 generation + 16 training GPUs",
        nemo("H100 BF16, GRPO Qwen3-30B3A 1-step Off", NEMO_V06), QWEN30,
        pool(2, 8, 2, "one_step_off") + NEMO_OFF_POLICY + [f"{A}.actor.megatron.optimizer_offload=false",
                                                           f"{A}.actor.megatron.pipeline_model_parallel_size=2"],
        "h100-sxm", 152, published_tokens_per_s_per_gpu=1414, g_avg_seq=3201,
        differences=NEMO_COMMON + NEMO_ASYNC + MOE),
    Row("V1-3", "verl", "Qwen2.5-Math-7B", "colocated sync, 16 GPUs (vLLM + Megatron)",
        verl(ONE_STEP_OFF, "colocate sync, vLLM+Megatron"), VERL7, [], "h20", 699,
        published_phases_s={"gen": 207, "old_log_prob": 119, "update_actor": 344},
        published_other_s={"generate_sequences": 162}, prompt_tokens=DAPO_PROMPT_TOKENS,
        differences=VERL_COMMON + [
            "Qwen2.5-Math-7B as configs/models/qwen2.5-7b (the same layer shapes)",
            "n = 16, the colocate script's at this commit (published_rows.md lists 12 for all four scripts; the 4_12 "
            "script has 12): 8,192 responses a step here against 6,144 in V1-4",
            "verl's 'gen' (207 s) also holds vLLM's wake-up and the weight sync; its generate_sequences is 162 s"]),
    Row("V1-4", "verl", "Qwen2.5-Math-7B", "one-step-off, 4 generation + 12 training GPUs",
        verl(ONE_STEP_OFF, "one-step-overlap async, vLLM+Megatron"), VERL7,
        pool(2, 2, 2, "one_step_off") + [
            "trainer.n_gpus_per_node=6", f"{A}.rollout.n=12", f"{A}.actor.megatron.param_offload=false",
            f"{A}.actor.megatron.optimizer_offload=false", f"{A}.actor.megatron.grad_offload=false"],
        "h20", 566, published_phases_s={"gen": 501, "old_log_prob": 120, "update_actor": 347},
        published_other_s={"wait_prev_gen": 59}, prompt_tokens=DAPO_PROMPT_TOKENS,
        differences=VERL_COMMON + [
            "Qwen2.5-Math-7B as configs/models/qwen2.5-7b (the same layer shapes)",
            "each node: 2 rollout + 6 training GPUs (trainer 2 x 6, rollout pool 2 x 2), TP2 PP2 -> DP3",
            "published gen here is verl's generate_sequences (the pool's own time); the trainer's wait_prev_gen "
            "(59 s) has no model counterpart (the model's step = max(gen, rest))"]),
    Row("V2-7", "verl", "Qwen3-30B-A3B-Base", "colocated sync, 128 GPUs (vLLM + Megatron)",
        verl(FULLY_ASYNC, "30B experiment, colocate sync 128"), VERL30,
        [f"{A}.actor.megatron.tensor_model_parallel_size=2", f"{A}.actor.megatron.sequence_parallel=true",
         f"{A}.actor.megatron.expert_tensor_parallel_size=null"],
        "h20", 497.89, published_phases_s={"gen": 348.05, "old_log_prob": 28.73, "ref": 20.86, "update_actor": 86.27},
        prompt_tokens=DAPO_PROMPT_TOKENS, differences=VERL_COMMON + V30_LAYOUT + MOE[:1]),
    Row("V2-8", "verl", "Qwen3-30B-A3B-Base", "fully async, 96 rollout : 32 training GPUs",
        verl(FULLY_ASYNC, "30B experiment, fully async 96:32"), VERL30,
        [f"{A}.actor.megatron.tensor_model_parallel_size=2", f"{A}.actor.megatron.sequence_parallel=true",
         f"{A}.actor.megatron.expert_tensor_parallel_size=null", f"{A}.actor.megatron.param_offload=false",
         "data.train_batch_size=480", f"{A}.actor.ppo_mini_batch_size=120", f"{A}.rollout.max_staleness=1",
         f"{A}.rollout.partial_rollout=true"] + pool(12, 8, 4, "fully_async"),
        "h20", 282.75, published_phases_s={"ref": 50.05, "update_actor": 206.63},
        published_other_s={"gen (the trainer's wait for samples)": 22.06}, prompt_tokens=DAPO_PROMPT_TOKENS,
        batch_scale=512 / 480,
        differences=VERL_COMMON + V30_LAYOUT + MOE[:1] + [
            "512 prompts a step do not split over the 24 vLLM replicas (96 GPUs / TP4), which hybridrl requires: "
            "480 prompts (mini-batch 120, 4 optimizer steps) here, the prediction scaled by 512/480 (exact for the "
            "training passes, an approximation for generation)",
            "fully async with staleness_threshold 0.5 (a share of extra samples), partial rollouts, weights synced "
            "every 4 mini-batches: modelled only as generation beside training (step = the longer); hybridrl's "
            "max_staleness counts weight versions (1 here) and the model syncs every step",
            "verl trains on the rollout's log-probs (use_rollout_log_probs, no old_log_prob pass); hybridrl runs the "
            "pass (4 optimizer steps a step), so its predicted training side is that pass longer",
            "param_offload is refused for a disaggregated trainer (nothing to make room for); grads and Adam's "
            "moments still offloaded as in the script"]),
)


def scaled_efficiency(multiplier: float) -> Efficiency:
    return dataclasses.replace(EFFICIENCY, **{name: getattr(EFFICIENCY, name) * multiplier for name in SCALED_FIELDS})


def lengths_for(row: Row, plan: Plan, response: float) -> StepLengths:
    return StepLengths(row.prompt_tokens, response, longest_response=plan.token_budget.response_tokens)


def predict(row: Row, plan: Plan, eff: Efficiency, response: float) -> StepTime:
    step = predict_step_time(plan, HARDWARE[row.hardware], eff, lengths_for(row, plan, response))
    if step is None:
        raise SystemExit(f"{row.id}: no prediction (no model shape)")
    return step


def bisect(f, low: float, high: float, iterations: int = 60) -> float:
    """The x in [low, high] where the increasing f crosses 0."""
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < 0 else (low, mid)
    return (low + high) / 2


def generation_waves(plan: Plan, prompt: float, response: float) -> int:
    """The waves `step_time.generation_seconds` runs a replica's sequences in (the same arithmetic), the last one
    decoding to the longest response."""
    seqs = plan.sequences_per_rollout_replica
    room = max(1, int(plan.rollout_memory.kv_cache_tokens // (prompt + response)))
    return math.ceil(seqs / min(seqs, plan.config.actor_rollout_ref.rollout.max_num_seqs, room))


def phases_s(step: StepTime, scale: float) -> dict[str, float]:
    return {name: round(step.phase(name) * scale, 2) for name in PHASES if any(p.phase == name for p in step.phases)}


def tokens_per_s_per_gpu(plan: Plan, prompt: float, response: float, step_s: float) -> float:
    return plan.sequences_per_step * (prompt + response) / step_s / plan.resolved.total_ranks


def evaluate(row: Row, plan: Plan, eff: Efficiency) -> dict:
    """The row's prediction: NeMo at its published lengths; verl at the mean response that meets its published step."""
    if row.g_avg_seq is not None:
        response = row.g_avg_seq - row.prompt_tokens
        step = predict(row, plan, eff, response)
        seconds = step.seconds * row.batch_scale
        out = {"mean_response_tokens": response, "step_s": round(seconds, 2),
               "error": round(seconds / row.published_step_s - 1, 4)}
    else:
        limit = plan.token_budget.response_tokens
        at = lambda r: predict(row, plan, eff, r).seconds * row.batch_scale - row.published_step_s
        shortest, longest = at(1.0) + row.published_step_s, at(limit) + row.published_step_s
        if shortest > row.published_step_s or longest < row.published_step_s:
            response = 1.0 if shortest > row.published_step_s else float(limit)
            out = {"mean_response_tokens": None, "step_s": round((shortest if response == 1 else longest), 2),
                   "note": f"no mean response in [1, {limit}] meets the published step: the prediction runs "
                           f"{shortest:.1f}-{longest:.1f} s over that range; phases shown at a mean response of "
                           f"{response:g} token(s)"}
        else:
            response = bisect(at, 1.0, float(limit))
            out = {"mean_response_tokens": round(response, 1), "step_s": round(at(response) + row.published_step_s, 2),
                   "note": "the mean response at which the prediction equals the published step (reported, not an "
                           "error)"}
        step = predict(row, plan, eff, response)
        seconds = step.seconds * row.batch_scale
    phases = phases_s(step, row.batch_scale)
    out["phases_s"] = phases
    out["phase_bounds"] = {p.phase: p.bound for p in step.phases}
    out["generation_waves"] = generation_waves(plan, row.prompt_tokens, response)
    out["phase_errors"] = {name: round(phases[name] / seconds_published - 1, 4)
                           for name, seconds_published in row.published_phases_s.items() if name in phases}
    out["tokens_per_s_per_gpu"] = round(tokens_per_s_per_gpu(plan, row.prompt_tokens, response, step.seconds), 1)
    return out


def calibrate(plans: dict[str, Plan]) -> float:
    """The multiplier of the training matmul efficiencies at which the calibration rows' mean log error is 0."""
    rows = [row for row in ROWS if row.id in CALIBRATION_ROWS]

    def mean_log_error(log_multiplier: float) -> float:
        eff = scaled_efficiency(math.exp(log_multiplier))
        return statistics.fmean(math.log(predict(row, plans[row.id], eff, row.g_avg_seq - row.prompt_tokens).seconds
                                         * row.batch_scale / row.published_step_s) for row in rows)

    # the error falls as the multiplier grows
    return math.exp(bisect(lambda x: -mean_log_error(x), math.log(0.05), math.log(20.0)))


def plan_row(row: Row) -> Plan:
    try:
        return plan_from_sources(ROOT / row.yaml, row.overrides)
    except ConfigError as exc:
        raise SystemExit(f"{row.id}: the job does not plan:\n{exc}") from None


def text_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items()) or "-"


def print_row(row: Row, out: dict) -> None:
    src = row.source
    print(f"\n{row.id}  {row.framework}  {row.model}  {row.mode}  [{row.hardware}, {out['gpus']} GPUs, "
          f"{out['samples_per_step']} samples a step]")
    print(f"  source: {src['repo']} {src['path']} @ {src['commit'][:12]} ({src['table']})")
    print(f"  job: {row.yaml}" + (f" + {' '.join(row.overrides)}" if row.overrides else ""))
    lengths = out["lengths"]
    print(f"  lengths: prompt {lengths['prompt_tokens']:g}, mean response {lengths['mean_response_tokens']}, longest "
          f"{lengths['longest_response']:g} ({lengths['basis']})")
    published = out["published"]
    extra = text_phases(published["other_phases_s"])
    print(f"  published: step {published['step_s']:g} s; phases {text_phases(published['phases_s'])}"
          + (f"; not modelled: {extra}" if published["other_phases_s"] else "")
          + (f"; {published['tokens_per_s_per_gpu']:g} tok/s/GPU (from the step: "
             f"{published['tokens_per_s_per_gpu_from_step']:.0f})" if published["tokens_per_s_per_gpu"] else ""))
    for name in ("default", "calibrated"):
        result = out[name]
        if row.g_avg_seq is not None:
            head = f"step {result['step_s']:.1f} s, error {result['error']:+.1%}"
        elif result["mean_response_tokens"] is None:
            head = f"implied mean response: none ({result['note']})"
        else:
            head = f"implied mean response {result['mean_response_tokens']:.0f} tokens"
        errors = ", ".join(f"{k} {v:+.0%}" for k, v in result["phase_errors"].items())
        print(f"  {name}: {head}; phases {text_phases(result['phases_s'])}"
              + (f" (phase errors {errors})" if errors else "") + f"; {result['tokens_per_s_per_gpu']:.0f} tok/s/GPU; "
              f"generation {result['generation_waves']} wave(s), the last {lengths['longest_response']:g} decode "
              "steps, "
              f"{result['phase_bounds'].get('gen', '-')}-bound")
    print("  differences:")
    for item in row.differences:
        print(f"    - {item}")


def main() -> None:
    plans = {row.id: plan_row(row) for row in ROWS}
    multiplier = calibrate(plans)
    calibrated = scaled_efficiency(multiplier)
    results = []
    for row in ROWS:
        plan = plans[row.id]
        nemo_row = row.g_avg_seq is not None
        out = {
            "id": row.id, "framework": row.framework, "model": row.model, "mode": row.mode, "source": row.source,
            "job": {"yaml": row.yaml, "overrides": row.overrides}, "hardware": row.hardware,
            "gpus": plan.resolved.total_ranks, "samples_per_step": plan.sequences_per_step,
            "batch_scale": round(row.batch_scale, 4),
            "lengths": {"prompt_tokens": row.prompt_tokens,
                        "mean_response_tokens": row.g_avg_seq - row.prompt_tokens if nemo_row else "solved",
                        "longest_response": plan.token_budget.response_tokens,
                        "basis": "G-avg seq - assumed mean prompt; longest = the response limit" if nemo_row else
                        "mean response solved so the prediction meets the published step; assumed mean prompt; "
                        "longest = the response limit"},
            "published": {
                "step_s": row.published_step_s, "phases_s": row.published_phases_s,
                "other_phases_s": row.published_other_s, "tokens_per_s_per_gpu": row.published_tokens_per_s_per_gpu,
                "g_avg_seq": row.g_avg_seq,
                "tokens_per_s_per_gpu_from_step": round(plan.sequences_per_step * row.batch_scale * row.g_avg_seq
                                                        / row.published_step_s / plan.resolved.total_ranks, 1)
                if nemo_row else None},
            "default": evaluate(row, plan, EFFICIENCY),
            "calibrated": evaluate(row, plan, calibrated),
            "calibration_row": row.id in CALIBRATION_ROWS,
            "plan_warnings": [w for w in plan.warnings if "Transformer Engine" not in w],
            "differences": row.differences,
        }
        results.append(out)
        print_row(row, out)

    nemo_rows = [r for r in results if r["published"]["g_avg_seq"] is not None]
    held_out = [r for r in nemo_rows if not r["calibration_row"]]
    summary = {
        "median_abs_error_nemo_default": round(statistics.median(abs(r["default"]["error"]) for r in nemo_rows), 4),
        "median_abs_error_nemo_calibrated_held_out": round(
            statistics.median(abs(r["calibrated"]["error"]) for r in held_out), 4),
        "median_abs_error_nemo_calibrated_all": round(
            statistics.median(abs(r["calibrated"]["error"]) for r in nemo_rows), 4),
        "held_out_rows": [r["id"] for r in held_out],
    }
    print("\n| row | GPUs | hw | published s | default s (err) | calibrated s (err) "
          "| tok/s/GPU pub / default / calib |")
    print("|---|---|---|---|---|---|---|")
    for r in nemo_rows:
        d, c, p = r["default"], r["calibrated"], r["published"]
        mark = " (fit)" if r["calibration_row"] else ""
        print(f"| {r['id']} | {r['gpus']} | {r['hardware']} | {p['step_s']:g} | {d['step_s']:.1f} ({d['error']:+.1%}) "
              f"| {c['step_s']:.1f} ({c['error']:+.1%}){mark} | {p['tokens_per_s_per_gpu']:g} / "
              f"{d['tokens_per_s_per_gpu']:.0f} / {c['tokens_per_s_per_gpu']:.0f} |")
    print("\n| row | GPUs | hw | published s | implied mean response, default eff | ... calibrated eff |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["published"]["g_avg_seq"] is not None:
            continue
        d, c = r["default"], r["calibrated"]
        implied = [f"{x['mean_response_tokens']:.0f} tokens" if x["mean_response_tokens"] is not None else
                   f"none (>= {x['step_s']:.0f} s at 1 token)" for x in (d, c)]
        print(f"| {r['id']} | {r['gpus']} | {r['hardware']} | {r['published']['step_s']:g} | {implied[0]} | "
              f"{implied[1]} |")
    print(f"\nmedian |error| over the 6 NeMo rows, default efficiency: {summary['median_abs_error_nemo_default']:.1%}")
    print(f"calibration on {' and '.join(CALIBRATION_ROWS)}: training matmul efficiencies x {multiplier:.3f} "
          f"({', '.join(f'{n} {getattr(calibrated, n):.3f}' for n in SCALED_FIELDS)})")
    print(f"median |error| over the {len(held_out)} held-out NeMo rows, calibrated: "
          f"{summary['median_abs_error_nemo_calibrated_held_out']:.1%} (all 6: "
          f"{summary['median_abs_error_nemo_calibrated_all']:.1%})")

    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "published peer-framework step times simulated with hybridrl's plan and step-time model "
                "(bench/published_rows.py)",
        "hardware": {name: dataclasses.asdict(hw) for name, hw in HARDWARE.items()},
        "h20_source": "NVIDIA H20 datasheet figures (dense BF16 148, FP32 44 TFLOP/s, HBM 4.0 TB/s, NVLink 900 GB/s "
                      "both directions); 400 Gb/s network and PCIe 5.0 as the shipped entries assume",
        "assumed_mean_prompt_tokens": {"nemo": NEMO_PROMPT_TOKENS, "verl": DAPO_PROMPT_TOKENS},
        "efficiency_default": dataclasses.asdict(EFFICIENCY),
        "calibration": {"rows": list(CALIBRATION_ROWS), "scaled_fields": list(SCALED_FIELDS),
                        "multiplier": round(multiplier, 4), "efficiency": dataclasses.asdict(calibrated)},
        "summary": summary,
        "rows": results,
    }, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
