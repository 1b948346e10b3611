"""A step's time, predicted from the plan and a hardware description (`config.hardware`): a roofline per phase.

Torch-free. Each phase is bound by what it moves or computes at a stated fraction of the hardware's peak
(`Efficiency`: named numbers, each saying where it comes from; not yet calibrated against measured GPU runs):

- generation, per rollout replica (its `infer_tp` GPUs): the prefill's matmul FLOPs (the prompt once per group,
  as vLLM's prefix cache holds it for the n samples) at the prefill efficiency; then one decode step per response
  token, in as many waves as the KV cache needs (with rows of varying lengths, continuous batching makes every wave
  but the last a mean response long, the last the longest), each step bound by reading the replica's weights and the
  KV cache of the sequences decoding together (memory bandwidth) or by their matmuls, whichever is slower;
- each forward pass (old, reference, teacher log-probs; values; reward scores): its FLOPs over the role's GPUs,
  stretched by the pipeline's fill and drain (1 + (PP - 1) / micro-batches), plus TP's activation collectives,
  PP's stage-to-stage sends and an MoE model's token dispatch over EP (`activation_traffic_seconds`, not overlapped
  with the matmuls);
- each update: forward and backward FLOPs (a recomputed forward more with gradient checkpointing) over the role's
  GPUs, the interleaved pipeline's bubble (1 + (PP - 1) / (micro-batches x VPP)), TP's and PP's activation traffic
  for the forward, the backward and a recompute, plus per optimizer step the
  data-parallel gradient reduction over the link its DP group spans (a ring all-reduce, 2 (DP - 1) / DP of the
  rank's gradients; with the distributed optimizer a reduce-scatter of them and an all-gather of the parameters,
  (DP - 1) / DP of each) and Adam's pass over the rank's share of its state (memory bandwidth), and per step what
  the role offloads to the host and back over PCIe (Adam's moments, parameters; freed gradient buffers move nothing);
  a LoRA actor's update computes no weight gradient of its frozen base (2 forwards of the weights, 3 of attention
  and of the adapters: `Plan.step_flops`), and reduces and steps its adapters alone;
- the weight sync: the resharder's most-loaded rank's bytes over NVLink, each rank's two copies of its generation
  shard (assembled, then into vLLM's weights), both sides' checksums of it (a streaming read) and each tensor's
  calls (colocated),
  or a training rank's share of the cross-pool bytes over the network (disaggregated); with adapters vLLM serves
  (`lora.merge: false`) the PEFT adapter instead: every rank receiving it whole (colocated: over the link the world
  spans), or a training rank sending it to each rollout rank it serves (disaggregated: over the network), and both
  sides' checksums of it; and its probe, one short row through the trainer and through vLLM, each side the slower
  of its matmuls and reading its weights (`probe_seconds`; disaggregated, the trainer's side runs while the rollout
  pool writes the last bucket);
- the switches between training and generation that move bytes over PCIe (on GPUs; on CPU nothing moves): a
  frozen role whose weights wait on the host between its passes (the reference always, a reward model or teacher
  with `megatron.param_offload`) brings them back for its pass and sends them out after, in that pass's phase (the
  actor's own `param_offload` is in its update's offload). vLLM going to sleep at level 2 (`release_rollout_memory`,
  merged weights) discards its weights, which the sync rewrites, and unmaps its KV cache: no bytes move, and the
  unmapping and mapping again are not modelled (a GPU run will say whether they matter);
- a hardware description's fixed costs (`Hardware.decode_step_ms`, `layer_pass_ms`, `link_latency_us`,
  `sync_tensor_ms`): each decode step and prefill call, each decoder layer's pass over a micro-batch, each collective
  or send, each tensor a sync writes (0 on the shipped GPUs).

The step: the phases' sum when generation and training take turns (sync), else the longer of generation and
the rest (one_step_off / fully_async: generation runs beside training).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hybridrl.config.estimates import DTYPE_BYTES, GIB, TrainingMemory, forward_flops, kv_bytes_per_token
from hybridrl.config.hardware import Efficiency, Hardware
from hybridrl.config.meshes import adapter_receivers
from hybridrl.config.model_shapes import ModelShape, role_model_shape
from hybridrl.config.plan import (
    PASS_PHASES,
    UPDATE_PHASES,
    VOCABULARY_ROLES,
    ForwardPlan,
    Plan,
    RoleLayout,
    UpdatePlan,
    full_recompute,
    recompute_share,
    served_adapter_bytes,
    step_flops_at,
)
from hybridrl.names import Phase, Role

# The sync's checksums (`parallel.digest.tensor_digest`) read each byte of a generation shard this many times over,
# per device: on CPU an integer matrix-vector product reads a word (8 B) and its two lane weights (16 B) once, ~3 B a
# byte; on CUDA the [2, chunk] product is written and read back besides (16 + 16 B a word more), ~7 B a byte.
DIGEST_READS_PER_BYTE = {"cpu": 3.0, "cuda": 7.0}

# The weight probe's row (`workers.probe.RARE_TOKEN_PROBE`: 8 prompt and 8 response tokens; a test holds them equal)
PROBE_TOKENS = 16

# megatron's DDP bucket (`DistributedDataParallelConfig.bucket_size` left unset) is max(40M, 1M x DP) parameters:
# the model takes its 40M floor, exact up to DP 40
DDP_BUCKET_PARAMS = 40_000_000

# Adam's bytes per parameter in one step: read params, grads and two fp32 moments, write params and moments
ADAM_BYTES_PER_PARAM = 4 * 7


@dataclass(frozen=True)
class StepLengths:
    """A step's rows as they ran, to predict that step instead of the plan's full-length rows: the trainer compares
    each step's measured phases with the prediction at its own lengths (`from_metrics`), so a run whose answers are
    short is not "faster than planned"."""

    prompt_tokens: float      # a row's mean prompt tokens
    response_tokens: float    # a row's mean response tokens
    longest_response: float   # the step's longest response: the decode steps its generation takes
    padding_ratio: float = 0.0  # the share of a training pass's computed tokens that are padding

    @property
    def computed_tokens(self) -> float:
        """A row's tokens as a training pass computes them, its padding included."""
        return (self.prompt_tokens + self.response_tokens) / max(1e-6, 1 - self.padding_ratio)

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> StepLengths | None:
        """From a step's `prompt_length/mean`, `response_length/mean` and `/max` and `perf/padding_ratio` (the actor
        update's); None when the step has not logged them."""
        keys = ("prompt_length/mean", "response_length/mean", "response_length/max")
        if any(key not in metrics for key in keys):
            return None
        prompt, response, longest = (float(metrics[key]) for key in keys)
        return cls(prompt, response, longest, float(metrics.get("perf/padding_ratio", 0.0)))


@dataclass(frozen=True)
class PhaseTime:
    phase: str
    seconds: float
    bound: str  # what limits it, in words: "matmul", "memory (decode)", "link", ...


@dataclass(frozen=True)
class StepTime:
    hardware: str
    phases: tuple[PhaseTime, ...]
    overlapped: bool  # generation beside training (an async mode)

    @property
    def seconds(self) -> float:
        total = sum(p.seconds for p in self.phases)
        if not self.overlapped:
            return total
        generation = self.phase(Phase.GEN)
        return max(generation, total - generation)

    def phase(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.phase == name)


def model_of(plan: Plan) -> ModelShape:
    """The plan's model shape; a prediction needs one (`predict_step_time` returns None without it)."""
    if plan.model is None:
        raise ValueError("the plan has no model shape to predict a step's time from")
    return plan.model


def generation_seconds(plan: Plan, hardware: Hardware, eff: Efficiency | None = None,
                       lengths: StepLengths | None = None) -> tuple[float, str]:
    """One step's generation on one rollout replica (every replica runs its share at once): the full-length rows, or
    the step's `lengths` (its mean prompt and response for the prefill and the KV cache, its longest response for the
    decode steps)."""
    config, resolved, model = plan.config, plan.resolved, model_of(plan)
    eff = eff or hardware.efficiency
    rollout = config.actor_rollout_ref.rollout
    tp, n = rollout.tensor_model_parallel_size, rollout.n
    prompt: float = config.data.max_prompt_length
    response: float = resolved.response_length
    if lengths is not None:
        prompt, response = lengths.prompt_tokens, lengths.response_tokens
    seqs = plan.sequences_per_rollout_replica
    peak = hardware.peak_flops(resolved.rollout_dtype)
    prefill = forward_flops(model, rows=seqs, layer_tokens=prompt / n, head_tokens=0, seq_len=max(1, round(prompt)),
                            vocab_head=True) / tp / (peak * eff.prefill_matmul)
    memory = plan.rollout_memory
    if memory is None:
        raise ValueError("the plan has no rollout memory: no model shape to predict its generation from")
    together = min(seqs, rollout.max_num_seqs, max(1, int(memory.kv_cache_tokens // (prompt + response))))
    waves = math.ceil(seqs / together)
    weights = memory.weights_gib * GIB
    kv = together * (prompt + response / 2) * kv_bytes_per_token(model, DTYPE_BYTES[resolved.rollout_dtype], tp)
    step_bytes = (weights + kv) / (hardware.memory_bytes_per_s * eff.decode_memory)
    step_flops = forward_flops(model, rows=together, layer_tokens=1, head_tokens=1,
                               seq_len=max(1, round(prompt + response)), vocab_head=True)
    step_flops /= tp * peak * eff.prefill_matmul
    # continuous batching: a slot freed by a finished sequence takes the next one, so every wave but the last lasts
    # a mean response and the last one the longest (full-length rows: `waves` x the response)
    longest = response if lengths is None else lengths.longest_response
    decode_steps = (waves - 1) * response + longest
    decode = decode_steps * max(step_bytes, step_flops)
    # each decode step's own fixed work, and the prefill's call (one per wave)
    fixed = (decode_steps + waves) * hardware.decode_step_ms / 1e3
    return prefill + decode + fixed, "memory (decode)" if step_bytes >= step_flops else "matmul (decode)"


def activation_traffic_seconds(plan: Plan, layout: RoleLayout, collective_passes: float, p2p_passes: float,
                               hardware: Hardware, eff: Efficiency | None = None,
                               row_tokens: float | None = None, micro_batches: int = 1,
                               head_passes: tuple[float, float] = (1, 0)) -> float:
    """What a role's model parallelism moves per rank in one step's pass(es) over the batch, not overlapped:

    - TP: per decoder layer a forward holds two all-reduces (attention's and the MLP's outputs; with sequence
      parallelism a reduce-scatter and an all-gather each, the same bytes) of the rank's tokens x hidden, a
      backward two more; a ring moves 2 (TP - 1) / TP of them, over the link the TP group spans. At the model's
      ends (`head_passes`: forwards, backwards; a stage's share of them, the first stage holding the embedding and
      the last the head): megatron's vocabulary-parallel embedding all-reduces its output in a forward, the
      vocabulary's output layer its input's gradient in a backward (each tokens x hidden; with sequence parallelism
      a reduce-scatter and an all-gather at each end instead, the same bytes and latencies), and the log-probs over
      the split vocabulary take three all-reduces of a float a token (`algorithms.vocab_parallel`: the maximum,
      the normalizers, the picked logit), whose latency alone counts;
    - PP: each stage sends its micro-batches' activations to the next (and their gradients back in a backward):
      the rank's tokens x hidden (its 1 / TP with sequence parallelism), over the network when a stage's ranks
      fill a machine or more;
    - EP (an MoE model at expert_model_parallel_size > 1): per MoE layer a forward holds two all-to-alls (the
      tokens to their experts, the experts' outputs back) of the rank's tokens x top_k x hidden (its 1 / TP with
      sequence parallelism), a backward two more; each sends (EP - 1) / EP of them, over the link the EP group
      spans (expert TP x EP consecutive ranks), each paying EP - 1 latencies a micro-batch.

    `collective_passes`: forwards and backwards (a recomputed forward counted); `p2p_passes`: forward and backward
    sends (a recompute sends nothing). The rank's tokens: the step's rows (`row_tokens` each, by default the full
    length) over DP and CP, in `micro_batches` micro-batches a pass: each micro-batch's collectives and sends pay the
    hardware's link latency (a ring's at each of its 2 (TP - 1) steps)."""
    mesh, mc = layout.mesh, layout.megatron
    eff = eff or hardware.efficiency
    model = role_model_shape(plan.config, layout.role, model_of(plan))
    row = plan.token_budget.sequence_tokens if row_tokens is None else row_tokens
    tokens = plan.sequences_per_step * row / (mesh.dp * mesh.cp)
    activation_bytes = tokens * model.hidden_size * DTYPE_BYTES[mc.dtype or plan.resolved.train_dtype]
    per_node = plan.config.trainer.n_gpus_per_node
    seconds = 0.0
    latency = hardware.link_latency_us / 1e6
    if mesh.tp > 1:
        ring = 2 * (mesh.tp - 1) / mesh.tp * activation_bytes
        layers = model.num_layers / mesh.pp
        end_rings, end_all_reduces = model_end_all_reduces(*head_passes, vocabulary=layout.role in VOCABULARY_ROLES)
        edge_rings, edge_latencies = end_rings / mesh.pp, end_all_reduces / mesh.pp
        rings = collective_passes * 2 * layers + edge_rings
        seconds += rings * ring / (hardware.link_bytes_per_s(mesh.tp > per_node) * eff.link)
        seconds += (collective_passes * 2 * layers + edge_latencies) * micro_batches * 2 * (mesh.tp - 1) * latency
    if mesh.pp > 1:
        sent = activation_bytes / (mesh.tp if mc.sequence_parallel_in_effect else 1)
        stage_ranks = mesh.world_size // mesh.pp
        seconds += p2p_passes * sent / (hardware.link_bytes_per_s(stage_ranks >= per_node) * eff.link)
        seconds += p2p_passes * micro_batches * latency
    ep = mc.expert_model_parallel_size
    if model.is_moe and ep > 1:
        moe_layers = len(model.moe_layers) / mesh.pp
        routed = activation_bytes / (mesh.tp if mc.sequence_parallel_in_effect else 1) * model.moe_top_k
        sent = (ep - 1) / ep * routed
        span = ep * (mc.expert_tensor_parallel_size or mesh.tp)
        seconds += collective_passes * 2 * moe_layers * sent / (hardware.link_bytes_per_s(span > per_node) * eff.link)
        seconds += collective_passes * 2 * moe_layers * micro_batches * (ep - 1) * latency
    return seconds


def model_end_all_reduces(forwards: float, backwards: float, *, vocabulary: bool) -> tuple[float, float]:
    """TP's all-reduces at the model's ends in `forwards` and `backwards` passes (`activation_traffic_seconds`): (those
    moving tokens x hidden: the embedding's output in a forward, a vocabulary head's input gradient in a backward;
    all of them, the log-probs' three of a float a token in a forward with a vocabulary head added)."""
    rings = forwards + (backwards if vocabulary else 0)
    return rings, rings + 3 * forwards * vocabulary


def layer_passes_seconds(plan: Plan, layout: RoleLayout, passes: float, hardware: Hardware) -> float:
    """The fixed cost of `passes` passes (a backward counts two) of a rank's decoder layers over a micro-batch."""
    layers = role_model_shape(plan.config, layout.role, model_of(plan)).num_layers / layout.mesh.pp
    return passes * layers * hardware.layer_pass_ms / 1e3


def digest_seconds(plan: Plan, hardware: Hardware, eff: Efficiency, synced_bytes: float) -> float:
    """Both sides' checksums of what a rank's sync writes (what was sent, what vLLM holds): a streaming read of each
    tensor."""
    return 2 * synced_bytes * DIGEST_READS_PER_BYTE[plan.config.trainer.device] / (
        hardware.memory_bytes_per_s * eff.stream_memory)


def predict_step_time(plan: Plan, hardware: Hardware, eff: Efficiency | None = None,
                      lengths: StepLengths | None = None) -> StepTime | None:
    """The step's phases on `hardware` (None without a model shape) at its efficiencies (or `eff`): the plan's
    full-length rows, or a step's own `lengths`."""
    if plan.model is None or plan.rollout_memory is None:
        return None
    eff = eff or hardware.efficiency
    row_tokens = None if lengths is None else lengths.computed_tokens
    flops = dict(plan.step_flops if lengths is None else
                 step_flops_at(plan, lengths.prompt_tokens, lengths.response_tokens, lengths.computed_tokens))
    memory = {m.role: m for m in plan.training_memory}
    gen, bound = generation_seconds(plan, hardware, eff, lengths)
    phases = [PhaseTime(Phase.GEN, gen, bound)]
    # a pass that does not run (the on-policy old-log-prob pass) has no FLOPs
    phases += [pass_time(plan, forward, flops[PASS_PHASES[forward.pass_name]], memory, hardware, eff, row_tokens)
               for forward in plan.forwards if PASS_PHASES[forward.pass_name] in flops]
    phases += [update_time(plan, update, flops[UPDATE_PHASES[Role(update.role)]], memory[update.role], hardware, eff,
                           row_tokens) for update in plan.updates]
    sync = sync_time(plan, hardware, eff)
    if sync is not None:
        phases.append(sync)
    return StepTime(hardware.name, tuple(phases), overlapped=plan.resolved.async_mode != "sync")


def pass_time(plan: Plan, forward: ForwardPlan, flops: float, memory: dict[str, TrainingMemory], hardware: Hardware,
              eff: Efficiency, row_tokens: float | None) -> PhaseTime:
    """A forward pass (old, reference, teacher log-probs; values; reward scores): its FLOPs over the role's GPUs
    stretched by the pipeline's fill and drain, the layers' fixed costs, the activation traffic, and the weights'
    round trip to the host when they wait there between passes."""
    layout = plan.layout(forward.role)
    peak = hardware.peak_flops(layout.megatron.dtype or plan.resolved.train_dtype)
    bubble = 1 + (layout.mesh.pp - 1) / max(1, forward.micro_batches_per_rank)
    seconds = flops / layout.mesh.world_size / (peak * eff.forward_matmul) * bubble
    seconds += layer_passes_seconds(plan, layout, forward.micro_batches_per_rank, hardware) * bubble
    seconds += activation_traffic_seconds(plan, layout, 1, 1, hardware, eff, row_tokens, forward.micro_batches_per_rank)
    if weights_wait_on_host(plan, Role(forward.role)):
        seconds += 2 * memory[forward.role].params_gib * GIB / (hardware.host_bytes_per_s * eff.link)
    return PhaseTime(PASS_PHASES[forward.pass_name], seconds, "matmul")


def update_time(plan: Plan, update: UpdatePlan, flops: float, role_memory: TrainingMemory, hardware: Hardware,
                eff: Efficiency, row_tokens: float | None) -> PhaseTime:
    """A trained role's update: forward and backward FLOPs (a recomputed forward more) over its GPUs with the
    interleaved pipeline's bubble, the activation traffic, and per optimizer step the DP gradient reduction and
    Adam's pass; per step what it offloads to the host and back."""
    layout = plan.layout(update.role)
    mesh, mc = layout.mesh, layout.megatron
    peak = hardware.peak_flops(mc.dtype or plan.resolved.train_dtype)
    recompute = 1 + recompute_share(plan, update.role) if full_recompute(plan.config, layout) else 1.0
    micro = update.grad_accum_steps or max(1, update.sequences_per_rank_per_mini_batch)
    bubble = 1 + (mesh.pp - 1) / (micro * (mesh.vpp or 1))
    compute = flops * recompute / mesh.world_size / (peak * eff.update_matmul) * bubble
    # forward, backward (two) and a recomputed forward of every micro-batch of every optimizer step
    passes = update.optimizer_steps_per_step * micro * (3 + (recompute > 1))
    compute += layer_passes_seconds(plan, layout, passes, hardware) * bubble
    compute += activation_traffic_seconds(plan, layout, update.ppo_epochs * (2 + (recompute > 1)),
                                          update.ppo_epochs * 2, hardware, eff, row_tokens,
                                          update.optimizer_steps_per_step // update.ppo_epochs * micro,
                                          head_passes=(update.ppo_epochs, update.ppo_epochs))
    params = role_memory.params_gib * GIB
    grads = role_memory.grads_gib * GIB
    # what trains: the whole model, or a LoRA actor's fp32 adapters alone (4 bytes an element, as their gradients:
    # the frozen base has no gradient, no optimizer state and no place in DDP's buffers)
    adapters = plan.resolved.trains_adapters(update.role)
    trained = grads if adapters else params
    span = mesh.tp * mesh.cp * mesh.dp  # consecutive ranks a DP group reaches across (megatron's order)
    # a ring all-reduce of the gradients; with the distributed optimizer a reduce-scatter of them and an
    # all-gather of the updated parameters instead
    ring_bytes = (mesh.dp - 1) / mesh.dp * (grads + trained if mc.use_distributed_optimizer else 2 * grads)
    ring = ring_bytes / (hardware.link_bytes_per_s(span > plan.config.trainer.n_gpus_per_node) * eff.link)
    elements = grads / 4 if adapters else params / DTYPE_BYTES[mc.dtype or plan.resolved.train_dtype]
    # megatron's DDP reduces in buckets of at least 40M parameters: each bucket's ring pays 2 (DP - 1) latencies
    ring += math.ceil(elements / DDP_BUCKET_PARAMS) * 2 * (mesh.dp - 1) * hardware.link_latency_us / 1e6
    shards = mesh.dp if mc.use_distributed_optimizer else 1
    adam = elements / shards * ADAM_BYTES_PER_PARAM / (hardware.memory_bytes_per_s * eff.optimizer_memory)
    # what the role offloads leaves the GPU after its update and comes back before the next (`training.offload`:
    # Adam's moments and the parameters are copied; the gradient buffers are freed and reallocated zeroed)
    offloaded = (role_memory.moments_gib * GIB if mc.optimizer_offload else 0.0) + (
        params if mc.param_offload else 0.0)
    offload = 2 * offloaded / (hardware.host_bytes_per_s * eff.link)
    return PhaseTime(UPDATE_PHASES[Role(update.role)],
                     compute + update.optimizer_steps_per_step * (ring + adam) + offload, "matmul")


def sync_time(plan: Plan, hardware: Hardware, eff: Efficiency) -> PhaseTime | None:
    """The weight sync and its probe: the served adapter alone, the cross-pool bytes, or the colocated resharder's
    traffic, then what vLLM's ranks write and check (None: a plan with no sync). Disaggregated, the trainer scores
    the probe while the rollout pool writes (`WorkerTopology.sync_weights` waits on both), then each replica
    scores it."""
    resolved, reshard = plan.resolved, plan.reshard
    per_node = plan.config.trainer.n_gpus_per_node
    actor = plan.layout(Role.ACTOR)
    trainer_probe, vllm_probe = probe_seconds(plan, hardware, eff)
    adapter = served_adapter_bytes(plan)
    if adapter:  # the adapter alone (the base crossed once, at set-up)
        digests = digest_seconds(plan, hardware, eff, adapter)
        if reshard.cross_pool is not None:
            trainers = actor.mesh.world_size
            most = max(len(adapter_receivers(r, trainers, resolved.rollout_world)) for r in range(trainers))
            sent = most * adapter / (hardware.link_bytes_per_s(True) * eff.link)
            return PhaseTime(Phase.SYNC, sent + max(trainer_probe, digests) + vllm_probe, "network")
        crosses = actor.mesh.world_size > per_node
        received = adapter / (hardware.link_bytes_per_s(crosses) * eff.link)
        return PhaseTime(Phase.SYNC, received + digests + trainer_probe + vllm_probe,
                         "network" if crosses else "NVLink")
    if reshard.cross_pool is not None:
        sent = reshard.cross_pool.bytes_sent_even / (hardware.link_bytes_per_s(True) * eff.link)
        shard = max(reshard.cross_pool.bytes_received)
        written = writes_seconds(plan, hardware, eff, shard)
        # the exchange goes bucket by bucket, each written before the next is received: the trainer's sends end with
        # the last bucket, and only that bucket's writing runs beside the trainer's probe
        last = written / max(1, math.ceil(shard / resolved.sync_bucket_bytes))
        return PhaseTime(Phase.SYNC, sent + written - last + max(trainer_probe, last) + vllm_probe, "network")
    if reshard.traffic is None:
        return None
    crosses = plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size > per_node
    traffic = reshard.traffic
    moved = max(traffic.bytes_received) / (hardware.link_bytes_per_s(crosses) * eff.link)
    written = writes_seconds(plan, hardware, eff, max(traffic.generation_shard_bytes))
    return PhaseTime(Phase.SYNC, moved + written + trainer_probe + vllm_probe,
                     "memory" if written >= moved else "network" if crosses else "NVLink")


def writes_seconds(plan: Plan, hardware: Hardware, eff: Efficiency, shard_bytes: float) -> float:
    """A vLLM rank's part of a merged sync: its whole generation shard copied twice (the resharder assembles each
    tensor from the pieces it holds and receives, `reshard.exchange`; vLLM copies it into its parameter), each copy
    a read and a write at memory bandwidth; both sides' checksums of it (what was produced or received, what vLLM
    holds); and each tensor's calls, whatever its size (`Hardware.sync_tensor_ms`)."""
    copied = 2 * 2 * shard_bytes / (hardware.memory_bytes_per_s * eff.optimizer_memory)
    calls = synced_tensors(model_of(plan)) * hardware.sync_tensor_ms / 1e3
    return copied + digest_seconds(plan, hardware, eff, shard_bytes) + calls


@functools.cache  # once per model in a layout search
def synced_tensors(model: ModelShape) -> int:
    """The tensors a sync writes into each vLLM rank: vLLM's parameters (its fused q/k/v and gate/up, each layer's
    experts stacked in one), from the family's weight table; the LM head only when not tied to the embedding."""
    weights = model.weights
    per_layer = sum(len({spec.vllm for spec in weights.layer if spec.exists(model, layer)})
                    for layer in range(model.num_layers))
    return per_layer + 2 + (0 if model.tie_word_embeddings else 1)


def probe_seconds(plan: Plan, hardware: Hardware, eff: Efficiency) -> tuple[float, float]:
    """The sync's proof, one short row (`PROBE_TOKENS`) scored by the trainer and by every vLLM replica: (the
    trainer's seconds, vLLM's). Each side is bound by its matmuls or by reading its weights, whichever is slower (a
    row this short is a decode step's work). The trainer's stages run one after another (the rank's weights read
    once a stage, PP times), each layer paying its fixed cost and TP's two all-reduces' latencies (and the
    embedding's and the log-probs' four, `activation_traffic_seconds`), each stage boundary a send's, and the
    results' gathers over the world; vLLM's side is one prefill call on the replica's TP ranks."""
    model = model_of(plan)
    actor = plan.layout(Role.ACTOR)
    mesh = actor.mesh
    flops = forward_flops(model, rows=1, layer_tokens=PROBE_TOKENS, head_tokens=PROBE_TOKENS, seq_len=PROBE_TOKENS,
                          vocab_head=True)
    memory = {m.role: m for m in plan.training_memory}[Role.ACTOR]
    read = memory.params_gib * GIB * mesh.pp / (hardware.memory_bytes_per_s * eff.decode_memory)
    computed = flops / mesh.tp / (hardware.peak_flops(actor.megatron.dtype or plan.resolved.train_dtype)
                                  * eff.forward_matmul)
    latency = hardware.link_latency_us / 1e6
    _, ends = model_end_all_reduces(1, 0, vocabulary=True)
    collectives = ((model.num_layers * 2 + ends) * 2 * (mesh.tp - 1) + (mesh.pp - 1)) * latency
    # the log-probs handed to every rank, and (colocated) every replica's gap: an object all-gather over the world
    # each, two all-gathers (the sizes, then the bytes) of world - 1 steps
    gathers = (1 if plan.reshard.cross_pool is not None else 2) * 2 * (mesh.world_size - 1) * latency
    trainer = max(read, computed) + layer_passes_seconds(plan, actor, mesh.pp, hardware) + collectives + gathers
    rollout_memory = plan.rollout_memory
    infer_tp = plan.config.actor_rollout_ref.rollout.tensor_model_parallel_size
    served = 0.0 if rollout_memory is None else rollout_memory.weights_gib * GIB
    vllm = max(served / (hardware.memory_bytes_per_s * eff.decode_memory),
               flops / infer_tp / (hardware.peak_flops(plan.resolved.rollout_dtype) * eff.prefill_matmul))
    return trainer, vllm + hardware.decode_step_ms / 1e3


def weights_wait_on_host(plan: Plan, role: Role) -> bool:
    """Whether a frozen role's weights go to the host after each pass and come back before the next
    (`workers.backends.FrozenBackend`): the reference's own model always (it shares the GPUs with the actor and
    vLLM; a LoRA actor's reference is its base, nothing moves), a reward model's or teacher's with
    `megatron.param_offload`. On CPU the host is the device: nothing moves."""
    if plan.resolved.device != "cuda":
        return False
    if role == Role.REF:
        return plan.resolved.lora_rank == 0
    return role in (Role.REWARD_MODEL, Role.TEACHER) and plan.layout(role).megatron.param_offload


def step_time_line(step: StepTime) -> str:
    """The prediction in one line: the step, then each phase's seconds and share of the phases' sum (async: the step
    is the longer of generation and the rest, both named, so the shares are not read as shares of the step)."""
    total = sum(p.seconds for p in step.phases)
    parts = ", ".join(f"{p.phase} {seconds_text(p.seconds)} ({p.seconds / (total or 1.0):.0%}, {p.bound})"
                      for p in step.phases)
    generation = step.phase(Phase.GEN)
    how = (f"generation beside the rest (async): the longer of generation {seconds_text(generation)} and the rest "
           f"{seconds_text(total - generation)}; shares of the phases' {seconds_text(total)}" if step.overlapped
           else "the phases one after another")
    return (f"Predicted step time on {step.hardware} (a roofline at stated efficiencies, not yet calibrated on GPUs; "
            f"{how}): {seconds_text(step.seconds)}: {parts}")


def seconds_text(value: float) -> str:
    return f"{value:.3g} s" if value >= 0.01 else f"{value * 1e3:.3g} ms"


def time_vs_plan(step: StepTime, measured: dict[str, float]) -> dict[str, float]:
    """Measured over predicted, per phase the prediction has and the step (`timing_s/<phase>` and `timing_s/step`
    in `measured`, as the trainer's timer writes them): `time_vs_plan/<phase>`; 1.0 is the plan's time."""
    out = {}
    for phase in step.phases:
        seconds = measured.get(f"timing_s/{phase.phase}")
        if seconds is not None and phase.seconds > 0:
            out[f"time_vs_plan/{phase.phase}"] = seconds / phase.seconds
    if "timing_s/step" in measured and step.seconds > 0:
        out["time_vs_plan/step"] = measured["timing_s/step"] / step.seconds
    return out
