"""Back-of-envelope per-GPU memory and resharding traffic, from the model shape and the layout.

Estimates, not measurements: they exist to stop a job that cannot fit before it starts and to
show what the colocated policy's resharding costs against the naive design. Formulas:
- weights/grads/optimizer: megatron mixed precision keeps bf16 params, fp32 main grads and fp32
  master params + Adam m, v (12 B/param), the last sharded over DP by the distributed optimizer;
- activations per micro-batch per layer ~ 34 * s * b * h bytes / TP (Korthikanti et al. 2022, flash
  attention so no s^2 term; with sequence parallel everything shards over TP), per pipeline stage
  (its own layers, the logits on the last; `ParallelLayout.stage_layers`, even or uneven), and 1F1B
  keeps PP - s micro-batches in flight on stage s;
- resharding: a rank must receive every byte of its generation shard it does not already hold
  (HybridFlow §5, Table 2); the naive design all-gathers the whole model on every rank;
- the per-GPU peak (`gpu_memory_plan`): each phase of a step sums what every role colocated on the GPU
  holds then (the actor's, the critic's and the reward model's processes share it with vLLM), the
  per-process and communicator overheads, and vLLM's start-up check; constants and their sources are
  with `GpuOverheads`;
- pipeline balance: a stage's share of a micro-batch's matmul FLOPs (2 per weight a token meets, an
  MoE layer's top-k experts only, causal attention's s/2 keys a token; the last stage's output layer
  only for the tokens it is computed on), since 1F1B runs at the pace of the heaviest stage.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from hybridrl.config.meshes import ReshardGroups, TrainingMesh, interval_overlap
from hybridrl.models.arch import ModelShape
from hybridrl.models.layout import ParallelLayout
from hybridrl.names import Role

GIB = 1024**3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
CPU_KV_BLOCK_SIZE = 32  # vLLM's CPU attention kernels take KV blocks of a multiple of 32 tokens


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's GPU: its decoder layers, parameters and estimated total."""

    stage: int
    layers: int
    params_gib: float
    total_gib: float


@dataclass(frozen=True)
class TrainingMemory:
    """The heaviest pipeline stage's GPU of one role; `stages` holds every stage's."""

    role: str
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    optimizer_gib_without_distributed: float
    activations_gib_per_micro_batch: float
    activations_gib_in_flight: float
    total_gib: float
    fits: bool
    stages: tuple[StageMemory, ...] = ()
    # the fp32 master weights inside `optimizer_gib` (16-bit training only): they stay on the GPU when
    # the optimizer is offloaded (`hybridrl.training.offload` moves Adam's moments only)
    master_params_gib: float = 0.0

    @property
    def moments_gib(self) -> float:
        """Adam's two moments (what `optimizer_offload` moves to the host between updates)."""
        return self.optimizer_gib - self.master_params_gib


@dataclass(frozen=True)
class RolloutMemory:
    """One vLLM rank's weights and KV cache. On GPU the cache is what `gpu_memory_utilization`
    leaves after the weights; on CPU it is its own allocation of `kv_cache_bytes`."""

    weights_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    kv_cache_tokens: int
    tokens_per_replica_step: int
    fits: bool
    kv_cache_bytes: int = 0
    on_cpu: bool = False

    @property
    def one_wave(self) -> bool:
        """Every sequence of a replica's step fits in the cache at once (no waiting, no preemption)."""
        return self.kv_cache_tokens >= self.tokens_per_replica_step


def embedding_params(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def output_params(shape: ModelShape) -> int:
    return 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size


def kv_bytes_per_token(shape: ModelShape, bytes_per_value: int, tp: int = 1) -> int:
    """KV-cache bytes one token costs on one of `tp` ranks (KV heads replicate when tp > kv)."""
    kv_heads_per_rank = max(1, shape.num_kv_heads // tp)
    return 2 * shape.num_layers * kv_heads_per_rank * shape.head_dim * bytes_per_value


@functools.lru_cache(maxsize=512)  # per model and layout: `hybridrl plan --search` plans many jobs on a few layouts
def stage_params(shape: ModelShape, layout: ParallelLayout) -> tuple[tuple[float, float], ...]:
    """(dense, expert) parameters one GPU of each pipeline stage holds, in stage order (embedding on the
    first stage, output layer on the last; each stage's own layers, VPP chunks included, as
    `ParallelLayout.chunks` places them): dense weights split over TP, an MoE layer's experts over EP
    and the expert TP, so that rank holds experts / EP of them, each split over the expert TP."""
    tp, ep, pp = layout.tp, layout.ep, layout.pp
    stages = []
    for stage in range(pp):
        layers = [i for chunk in layout.chunks(shape.num_layers, stage) for i in chunk.layers]
        experts = sum(shape.expert_params_of_layer(i) for i in layers)
        dense = sum(shape.params_of_layer(i) for i in layers) - experts
        if stage == 0:
            dense += embedding_params(shape)
        if stage == pp - 1:
            dense += shape.hidden_size + output_params(shape)
        stages.append((dense / tp, experts / (ep * layout.expert_tp)))
    return tuple(stages)


@dataclass(frozen=True)
class StageBalance:
    """How one role's matmul FLOPs split over its pipeline stages, and the split that evens them.

    1F1B moves every micro-batch at the pace of the heaviest stage, so the pipeline's time scales with
    `max(shares)` (1 / pp is perfect). `best_first` / `best_last` are megatron's
    num_layers_in_first/last_pipeline_stage giving the lowest heaviest stage (both None: the even split;
    equal to the configured ones when nothing beats them)."""

    role: str
    layers: tuple[int, ...]        # decoder layers per stage, as configured
    shares: tuple[float, ...]      # each stage's share of the FLOPs, as configured
    best_layers: tuple[int, ...]
    best_shares: tuple[float, ...]
    best_first: int | None
    best_last: int | None
    head_tokens_per_row: int       # tokens of a row the output layer is computed on
    vocab_head: bool               # the output layer is the vocabulary (not a value head)

    @property
    def gain(self) -> float:
        """The share of the pipeline's time the best split saves: 1 - max(best) / max(configured)."""
        return 1.0 - max(self.best_shares) / max(self.shares)


def split_text(layers: tuple[int, ...]) -> str:
    """Layers per stage as the plan writes them: "15+15"."""
    return "+".join(map(str, layers))


def shares_text(shares: tuple[float, ...]) -> str:
    """Stage shares as the plan writes them: "42%/58%"."""
    return "/".join(f"{share:.0%}" for share in shares)


def layer_flops_per_token(shape: ModelShape, layer: int, seq_len: int) -> float:
    """Forward matmul FLOPs one token costs in decoder layer `layer` of a `seq_len` sequence: 2 per weight
    it meets (an MoE layer: the router and its top-k experts only) and causal attention's QK^T and AV
    over s/2 keys on average."""
    experts = shape.expert_params_of_layer(layer)
    routed = experts * shape.moe_top_k / shape.num_experts if experts else 0.0
    return 2.0 * (shape.params_of_layer(layer) - experts + routed) + 2.0 * seq_len * shape.q_size


@functools.lru_cache(maxsize=256)
def decoder_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """`layer_flops_per_token` summed over the decoder layers (once per model and length)."""
    return sum(layer_flops_per_token(shape, i, seq_len) for i in range(shape.num_layers))


def forward_flops(shape: ModelShape, *, rows: int, layer_tokens: float, head_tokens: float, seq_len: int,
                  vocab_head: bool) -> float:
    """Forward matmul FLOPs of `rows` rows: every decoder layer on `layer_tokens` tokens a row (`layer_flops_per_token`)
    and the output layer on `head_tokens` (the vocabulary, else a value head)."""
    layers = decoder_flops_per_token(shape, seq_len)
    head = 2.0 * shape.hidden_size * (shape.vocab_size if vocab_head else 1)
    return rows * (layer_tokens * layers + head_tokens * head)


def _even_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...] | None:
    """megatron's layers per stage for a first/last setting (the rest split evenly), None where it
    refuses the split (`ParallelLayout.split_errors`, without VPP)."""
    set_ = [c for c in (first, last) if c is not None]
    middle_stages, middle_layers = pp - len(set_), num_layers - sum(set_)
    if any(c < 1 for c in set_) or (middle_stages == 0 and middle_layers) or middle_layers < middle_stages:
        return None
    if middle_stages and middle_layers % middle_stages:
        return None
    share = middle_layers // middle_stages if middle_stages else 0
    counts = [share] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


@functools.lru_cache(maxsize=512)  # a search over every first/last split: once per model, layout and lengths
def stage_balance(role: str, shape: ModelShape, layout: ParallelLayout, *, layer_tokens: float,
                  head_tokens: int, seq_len: int, vocab_head: bool) -> StageBalance | None:
    """Each pipeline stage's share of a row's forward (and so backward) matmul FLOPs, and the
    first/last split that minimizes the heaviest (None without PP, or with VPP, whose interleaved chunks
    this does not model). `layer_tokens`: the tokens of a row every layer computes; `head_tokens`: those
    the output layer computes (the response tokens: the loss reads no other logits); `vocab_head`: the
    output layer is the vocabulary (actor, reference), else a value head (critic, reward model)."""
    if layout.pp < 2 or layout.vpp:
        return None
    per_layer = [layer_tokens * layer_flops_per_token(shape, i, seq_len) for i in range(shape.num_layers)]
    prefix = [0.0]
    for flops in per_layer:
        prefix.append(prefix[-1] + flops)
    head = head_tokens * 2.0 * shape.hidden_size * (shape.vocab_size if vocab_head else 1)

    def costs(counts: tuple[int, ...]) -> list[float]:
        out = [prefix[end] - prefix[end - count] for end, count in zip(itertools.accumulate(counts), counts)]
        out[-1] += head
        return out

    def shares(counts: tuple[int, ...]) -> tuple[float, ...]:
        stage_costs = costs(counts)
        return tuple(c / sum(stage_costs) for c in stage_costs)

    configured = layout.stage_layers(shape.num_layers)
    best, best_max = (layout.first_stage_layers, layout.last_stage_layers, configured), max(costs(configured))
    choices = [None, *range(1, shape.num_layers)]
    for first in choices:
        for last in choices:
            counts = _even_counts(shape.num_layers, layout.pp, first, last)
            if counts is None:
                continue
            heaviest = max(costs(counts))
            # strictly better by more than rounding; among equals, the fewer settings (the even split first)
            if heaviest < best_max * (1 - 1e-9) or (
                    heaviest <= best_max * (1 + 1e-9) and [first, last].count(None) > [best[0], best[1]].count(None)):
                best, best_max = (first, last, counts), heaviest
    return StageBalance(role, configured, shares(configured), best[2], shares(best[2]), best[0], best[1],
                        head_tokens, vocab_head)


def training_memory(
    role: str, shape: ModelShape, mesh: TrainingMesh, *, dtype: str, distributed_optimizer: bool,
    trainable: bool, micro_batch: int, seq_len: int, sequence_parallel: bool, gpu_gib: float, ep: int = 1,
    etp: int | None = None, recompute: bool = False, value_head: bool = False, head_tokens: int | None = None,
    adapter_elements_per_layer: int = 0,
) -> TrainingMemory:
    """The heaviest pipeline stage's GPU (its figures; `stages` has every stage's). `ep`, `etp`: expert
    parallelism and expert TP of an MoE model (`etp` None: TP); the distributed optimizer shards
    dense weights' state over DP and the experts' over the expert-data-parallel ranks,
    TP x CP x DP / (EP x ETP). Activations: a stage's own layers; the fp32 logits on the last stage
    only, on the `head_tokens` of a row (default all: the policy's passes compute them on the response
    tokens only), one column for a value head (critic, reward model); 1F1B keeps pp - s micro-batches
    in flight on stage s (the first stage the most). `recompute` (full, uniform, one layer at a time:
    `model.enable_gradient_checkpointing`): a micro-batch keeps each layer's input only (2 s b h bytes,
    over TP with sequence parallelism) and one layer's whole activations while it is recomputed.
    `adapter_elements_per_layer` (a LoRA actor, per TP rank): the model frozen, the fp32 adapters the only
    trained parameters (their gradients and Adam's moments, no master copy); activations as without them (on a GPU
    its local spec's attention is PyTorch's fused kernel, `parallel.sdpa_attention`: no scores held)."""
    layout = mesh.layout(ep, etp)
    p_bytes = DTYPE_BYTES[dtype]
    # fp32 master copy only when compute is in 16-bit; Adam m and v are always fp32.
    master_bytes = 4 if p_bytes < 4 else 0
    opt_bytes = master_bytes + 8
    expert_dp = max(1, mesh.tp * mesh.dp * mesh.cp // (ep * layout.expert_tp))
    tokens = micro_batch * seq_len / mesh.cp
    per_layer = 34 * tokens * shape.hidden_size * p_bytes / 2  # 34 sbh counts 2-byte activations
    per_layer = per_layer / mesh.tp if sequence_parallel else per_layer * (10 + 24 / mesh.tp) / 34
    layer_input = tokens * shape.hidden_size * p_bytes / (mesh.tp if sequence_parallel else 1)
    # fp32 logits + their gradient. Not divided by CP: each CP rank gathers the last stage's hidden
    # states over CP and computes the whole micro-batch's output layer (training/backend.py).
    head_rows = micro_batch * (seq_len if head_tokens is None else head_tokens)
    logits = head_rows * (1 if value_head else shape.vocab_size / mesh.tp) * 4 * 2
    stage_layers = layout.stage_layers(shape.num_layers)
    memories = []
    for stage, (dense, experts) in enumerate(stage_params(shape, layout)):
        params = dense + experts
        params_gib = params * p_bytes / GIB
        if adapter_elements_per_layer and trainable:  # LoRA: the fp32 adapters train, the model is frozen
            adapters = adapter_elements_per_layer * stage_layers[stage]
            params_gib += adapters * 4 / GIB
            grads_gib = adapters * 4 / GIB
            opt_full = adapters * 8 / GIB
            opt = opt_full / (mesh.dp if distributed_optimizer else 1)
            master = 0.0
        else:
            grads_gib = params * 4 / GIB if trainable else 0.0
            opt_full = params * opt_bytes / GIB if trainable else 0.0
            opt_share = ((dense / mesh.dp + experts / expert_dp) if (distributed_optimizer and trainable)
                         else params if trainable else 0.0)
            opt = opt_share * opt_bytes / GIB
            # the distributed optimizer's fp32 master shard is as sharded as Adam's moments
            master = opt_share * master_bytes / GIB
        head = logits if stage == mesh.pp - 1 else 0.0
        if not trainable:  # forward only: one layer's working set
            act = (per_layer + head) / GIB
            in_flight = act
        elif recompute:  # each layer's input kept; one layer recomputed whole at a time in the backward
            act = (stage_layers[stage] * layer_input + head) / GIB
            in_flight = act * (mesh.pp - stage) + per_layer / GIB
        else:
            act = (stage_layers[stage] * per_layer + head) / GIB
            in_flight = act * (mesh.pp - stage)
        total = params_gib + grads_gib + opt + in_flight
        memories.append((stage_layers[stage], params_gib, grads_gib, opt, opt_full, act, in_flight, master, total))
    _, params_gib, grads_gib, opt, opt_full, act, in_flight, master, total = max(memories, key=lambda m: m[-1])
    stages = tuple(StageMemory(stage, m[0], round(m[1], 3), round(m[-1], 3)) for stage, m in enumerate(memories))
    return TrainingMemory(
        role, round(params_gib, 3), round(grads_gib, 3), round(opt, 3), round(opt_full, 3),
        round(act, 3), round(in_flight, 3), round(total, 3), total <= gpu_gib, stages, round(master, 3),
    )


def kv_cache_bytes_needed(shape: ModelShape, infer_tp: int, *, dtype: str, sequences: int, seq_len: int,
                          block_size: int = CPU_KV_BLOCK_SIZE) -> int:
    """KV-cache bytes on one rank for `sequences` sequences of `seq_len` tokens held at once.

    Each sequence holds whole blocks; one spare block per sequence and vLLM's reserved null block
    are the margin (prefix caching, which shares a prompt's blocks among its samples, only lowers it).
    """
    blocks = sequences * (-(-seq_len // block_size) + 1) + 1
    return blocks * block_size * kv_bytes_per_token(shape, DTYPE_BYTES[dtype], infer_tp)


def rollout_memory(
    shape: ModelShape, infer_tp: int, *, dtype: str, gpu_gib: float, gpu_memory_utilization: float,
    sequences_per_replica: int, seq_len: int, cpu_kv_cache_bytes: int | None = None,
) -> RolloutMemory:
    """`cpu_kv_cache_bytes` set: the CPU case, where the KV cache is that allocation."""
    p_bytes = DTYPE_BYTES[dtype]
    weights = shape.param_count() * p_bytes / infer_tp / GIB
    if cpu_kv_cache_bytes is not None:
        kv_gib = cpu_kv_cache_bytes / GIB
    else:
        kv_gib = max(0.0, gpu_gib * gpu_memory_utilization - weights)
    per_token = kv_bytes_per_token(shape, p_bytes, infer_tp)
    capacity = int(kv_gib * GIB // per_token) if per_token else 0
    return RolloutMemory(
        round(weights, 3), round(kv_gib, 3), per_token, capacity, sequences_per_replica * seq_len,
        fits=kv_gib > 0 and capacity >= seq_len,
        kv_cache_bytes=cpu_kv_cache_bytes if cpu_kv_cache_bytes is not None else int(kv_gib * GIB),
        on_cpu=cpu_kv_cache_bytes is not None,
    )


@dataclass(frozen=True)
class GpuOverheads:
    """What a GPU holds besides the roles' tensors and vLLM's share, with where each figure comes from.

    Estimates until a multi-GPU run measures them (`bench/gpu_check.sh` records what one GPU can):
    - a CUDA context per process on the GPU (torch, cuBLAS and NCCL kernels loaded lazily): vLLM reports
      0.5-1 GiB of such "non-torch" memory per process on Hopper;
    - NCCL: memory grows linearly with a communicator's channels (up to 32 on NVLink) and each needs
      its own buffers (NVIDIA/nccl#986: "more communicators = more memory"); ~0.5 GiB for a ring/tree
      communicator at NVLink speed, and an all-to-all connects every pair over 32 channels: 1.06 -> 4.34
      GB on one 8 x H100 rank after the first `all_to_all_single` (NVIDIA/nccl#1685);
    - vLLM asleep frees its weights and KV cache but not its CUDA graphs' memory pool (~1 GiB when graphs
      are captured, i.e. `rollout.enforce_eager` false) nor its TP communicators' all-reduce workspaces
      (`vllm_tp_workspace_gib`);
    - a margin for what is not modelled: the caching allocator's fragmentation, cuBLAS/attention
      workspaces, temporaries of the loss and the optimizer step.
    """

    cuda_context_gib: float = 0.75
    nccl_collective_gib: float = 0.5
    nccl_all_to_all_gib: float = 3.0
    vllm_cuda_graphs_gib: float = 1.0
    margin_fraction: float = 0.05

    def nccl_gib(self, collective: int, all_to_all: int) -> float:
        return collective * self.nccl_collective_gib + all_to_all * self.nccl_all_to_all_gib


OVERHEADS = GpuOverheads()
MIB = 1024**2
# vLLM 0.32's TP all-reduce buffers, which stay allocated while vLLM sleeps (by TP size; the largest over
# Hopper and Blackwell, whose tables differ, as the plan does not know the GPU): torch symmetric memory
# (`SYMM_MEM_ALL_REDUCE_MAX_SIZES`, VLLM_ALLREDUCE_USE_SYMM_MEM on by default), FlashInfer's fused
# all-reduce (`FI_ALLREDUCE_FUSION_MAX_SIZE_MB`, VLLM_ALLREDUCE_USE_FLASHINFER on by default; its
# Lamport workspace holds three buffers of the largest message for every peer). The rollout engine turns
# vLLM's custom all-reduce off (`disable_custom_all_reduce`), which leaves these two on.
_SYMM_MEM_MIB = {2: 64, 4: 32, 6: 128, 8: 128}
_FLASHINFER_MIB = {2: 64, 4: 64, 6: 0, 8: 4}


def vllm_tp_workspace_gib(infer_tp: int) -> float:
    """The all-reduce workspaces one vLLM rank of a TP group keeps through sleep (0 at TP 1)."""
    if infer_tp <= 1:
        return 0.0
    symm = _SYMM_MEM_MIB.get(infer_tp, max(_SYMM_MEM_MIB.values()))
    flashinfer = 3 * _FLASHINFER_MIB.get(infer_tp, max(_FLASHINFER_MIB.values())) * infer_tp
    return (symm + flashinfer) * MIB / GIB


def nccl_communicators(mesh: TrainingMesh, ep: int = 1, etp: int | None = None) -> tuple[int, int]:
    """(collective, all-to-all) NCCL communicators a training process of `mesh` uses: the world group
    (hybridrl's object broadcasts and barriers), one per parallel dimension above 1 (TP, PP, DP, CP), the
    model-parallel group when TP x PP > 1 (megatron's grad-norm all-reduce), and for an MoE model at EP > 1
    the expert all-to-all group plus the expert-data-parallel group when it has several ranks."""
    collective = 1 + sum(size > 1 for size in (mesh.tp, mesh.pp, mesh.dp, mesh.cp)) + int(mesh.tp * mesh.pp > 1)
    all_to_all = int(ep > 1)
    expert_dp = mesh.tp * mesh.dp * mesh.cp // (ep * (etp or mesh.tp))
    collective += int(ep > 1 and expert_dp > 1)
    return collective, all_to_all


@dataclass(frozen=True)
class RoleOnGpu:
    """A role as one GPU holds it: its memory estimate, what it keeps there between its own phases, and its
    process's NCCL communicators. The reference policy is offloaded between its passes (it shares the
    actor's process); the others keep what their settings do not offload."""

    memory: TrainingMemory
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    own_process: bool = True
    communicators: tuple[int, int] = (1, 0)  # (collective, all-to-all)

    @property
    def role(self) -> str:
        return self.memory.role

    def _state(self, *, params: bool, grads: bool, moments: bool) -> list[tuple[str, float]]:
        """(item, GiB) of its tensors, those named kept; the fp32 master weights always (no offload moves them)."""
        m = self.memory
        items = [(f"{self.role} params", m.params_gib)] if params else []
        if m.grads_gib and grads:
            items.append((f"{self.role} grads", m.grads_gib))
        if m.master_params_gib:
            items.append((f"{self.role} fp32 master params", m.master_params_gib))
        if m.moments_gib and moments:
            items.append((f"{self.role} Adam moments", m.moments_gib))
        return items

    def held(self, *, built_only: bool = False) -> list[tuple[str, float]]:
        """(item, GiB) it keeps on the GPU outside its own phases; `built_only`: as built, before its first
        update (Adam's moments are made at the first step on GPUs; grads offloaded at set-up when configured)."""
        if self.role == Role.REF:
            return []
        return self._state(params=not self.offload_params, grads=not self.offload_grads,
                           moments=not self.offload_optimizer and not built_only)

    def working(self) -> list[tuple[str, float]]:
        """(item, GiB) during its own heaviest phase: everything, activations in flight included."""
        return [*self._state(params=True, grads=True, moments=True),
                (f"{self.role} activations", self.memory.activations_gib_in_flight)]


@dataclass(frozen=True)
class PhaseMemory:
    """One phase of a step on one GPU: what is allocated then, item by item (GiB)."""

    name: str
    items: tuple[tuple[str, float], ...]

    @property
    def total_gib(self) -> float:
        return round(sum(gib for _, gib in self.items), 3)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """The per-GPU peak over a step's phases, every colocated role counted, and vLLM's start-up check.

    vLLM 0.32 refuses to start unless the GPU's free memory is at least gpu_memory_utilization x its total
    (`vllm/v1/worker/utils.py` `request_memory`): what the actor's process holds when the engine is built
    (`startup`) must leave that free. The plan fits when the heaviest phase plus the margin is within
    the GPU and the start-up check passes."""

    gpu_gib: float
    margin_gib: float
    phases: tuple[PhaseMemory, ...]
    startup: PhaseMemory | None = None
    startup_limit_gib: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def peak(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.total_gib)

    @property
    def peak_gib(self) -> float:
        return round(self.peak.total_gib + self.margin_gib, 3)

    @property
    def startup_fits(self) -> bool:
        return self.startup is None or self.startup.total_gib <= self.startup_limit_gib

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.gpu_gib and self.startup_fits

    def phase(self, name: str) -> PhaseMemory:
        return next(p for p in self.phases if p.name == name)


def gpu_memory_plan(
    roles: tuple[RoleOnGpu, ...], *, gpu_gib: float, gpu_memory_utilization: float | None,
    infer_tp: int = 1, cuda_graphs: bool = False, device_overheads: bool = True,
    overheads: GpuOverheads = OVERHEADS,
) -> GpuMemoryPlan:
    """The phases of a step on one GPU of the training ranks. `gpu_memory_utilization` None: no vLLM on
    these GPUs (a disaggregated rollout pool). `device_overheads` False (CPU): no CUDA contexts, NCCL
    communicators or vLLM workspaces, and no start-up check (vLLM's CPU cache is its own allocation)."""
    by_role = {r.role: r for r in roles}
    processes = [r for r in roles if r.own_process]
    common: list[tuple[str, float]] = []
    if device_overheads:
        common.append((f"CUDA contexts ({len(processes)} processes)", len(processes) * overheads.cuda_context_gib))
        collective = sum(r.communicators[0] for r in processes)
        all_to_all = sum(r.communicators[1] for r in processes)
        if gpu_memory_utilization is not None and infer_tp > 1:
            collective += 1  # vLLM's TP group (pynccl), in the actor's process
        common.append((f"NCCL ({collective} communicators" + (f", {all_to_all} all-to-all)" if all_to_all else ")"),
                       overheads.nccl_gib(collective, all_to_all)))
    asleep: list[tuple[str, float]] = []
    if gpu_memory_utilization is not None and device_overheads:
        workspace = vllm_tp_workspace_gib(infer_tp)
        if workspace:
            asleep.append((f"vLLM asleep: TP{infer_tp} all-reduce workspaces", workspace))
        if cuda_graphs:
            asleep.append(("vLLM asleep: CUDA graph pool", overheads.vllm_cuda_graphs_gib))

    def others(busy: str) -> list[tuple[str, float]]:
        return [item for r in roles if r.role != busy for item in r.held()]

    phases: list[PhaseMemory] = []
    startup = None
    startup_limit = 0.0
    if gpu_memory_utilization is not None:
        vllm = (f"vLLM (gpu_memory_utilization {gpu_memory_utilization:g} x {gpu_gib:g})",
                gpu_memory_utilization * gpu_gib)
        phases.append(PhaseMemory("generation", tuple([vllm, *[i for r in roles for i in r.held()], *common])))
        if device_overheads and Role.ACTOR in by_role:
            actor = by_role[Role.ACTOR]
            startup = PhaseMemory("vLLM start-up", (
                *actor.held(built_only=True), ("CUDA context (actor process)", overheads.cuda_context_gib),
                (f"NCCL ({actor.communicators[0]} communicators of the actor)",
                 overheads.nccl_gib(*actor.communicators))))
            startup_limit = round(gpu_gib * (1 - gpu_memory_utilization), 3)
    for r in roles:
        name = f"{r.role} update" if r.memory.grads_gib else f"{r.role} pass"
        phases.append(PhaseMemory(name, tuple([*r.working(), *others(r.role), *asleep, *common])))
    notes = []
    if device_overheads:
        notes.append(f"per process {overheads.cuda_context_gib:g} GiB of CUDA context; NCCL "
                     f"{overheads.nccl_collective_gib:g} GiB a communicator ({overheads.nccl_all_to_all_gib:g} "
                     f"all-to-all); margin {overheads.margin_fraction:.0%} of the GPU for fragmentation and "
                     "workspaces not modelled")
    margin = round(gpu_gib * overheads.margin_fraction, 3) if device_overheads else 0.0
    return GpuMemoryPlan(gpu_gib, margin, tuple(phases), startup, startup_limit, tuple(notes))


@dataclass(frozen=True)
class ReshardTraffic:
    """Bytes each rank receives in one weight sync, under three designs."""

    bytes_received: tuple[int, ...]     # with the planned HybridFlow groups
    lower_bound: tuple[int, ...]        # what the rank must receive under any grouping
    naive_gather_all: tuple[int, ...]   # every rank gathers the whole model
    generation_shard_bytes: tuple[int, ...]
    model_bytes: int

    @property
    def ratio_to_lower_bound(self) -> float:
        bound = sum(self.lower_bound)
        return sum(self.bytes_received) / bound if bound else 1.0


def reshard_traffic(shape: ModelShape, mesh: TrainingMesh, groups: ReshardGroups, dtype: str,
                    ep: int = 1, etp: int | None = None) -> ReshardTraffic:
    """Per-rank traffic of a training-layout -> vLLM-layout weight sync.

    TP-split tensors are counted as slices of their split dimension, replicated ones (norms) whole;
    KV-head replication when infer_tp > KV heads and vocab padding are ignored (small). Layers sit
    on megatron's stages (interleaved with VPP, even or uneven: `ParallelLayout.all_chunks`); with
    tied embeddings and pp > 1 the last stage holds megatron's copy of the embedding, which counts
    as held there. MoE experts: a rank holds
    1 / ep of them (its EP rank's), each split over the expert TP (`etp`, None: TP) like a dense MLP
    over TP, while every vLLM rank needs all experts (TP over each expert's width); the router is
    counted with the layer's TP-split part.
    """
    p_bytes = DTYPE_BYTES[dtype]
    t, t_g, p = mesh.tp, groups.rollout.infer_tp, mesh.pp
    layout = mesh.layout(ep, etp)
    x = layout.expert_tp
    stage_of = {layer: chunk.pp_rank for chunk in layout.all_chunks(shape.num_layers) for layer in chunk.layers}
    norms = 2 * shape.hidden_size
    embedding_holders = {0, p - 1} if shape.tie_word_embeddings else {0}

    def expert_params(layer: int) -> int:
        return sum(shape.hf_numel(tensor) * shape.num_experts for spec in shape.weights.layer
                   if spec.expert and spec.exists(shape, layer) for tensor in spec.hf)

    # (stages holding it, split params, replicated params, split params of experts) per piece
    pieces = [(frozenset(embedding_holders), embedding_params(shape), 0, 0)]
    pieces += [
        (frozenset({stage_of[layer]}), shape.params_of_layer(layer) - norms - expert_params(layer),
         norms, expert_params(layer))
        for layer in range(shape.num_layers)
    ]
    pieces.append((frozenset({p - 1}), output_params(shape), shape.hidden_size, 0))
    model = sum(split + rep + experts for _, split, rep, experts in pieces) * p_bytes

    gen_size = sum((split + experts) / t_g + rep for _, split, rep, experts in pieces)
    # each stage's (split, replicated, expert) parameters: what a rank holds is linear in them
    on_stage = [tuple(sum(piece[i] for piece in pieces if stage in piece[0]) for i in (1, 2, 3)) for stage in range(p)]

    @functools.cache
    def per_rank(tp_rank: int, pp_rank: int, etp_rank: int, gen_tp_index: int) -> tuple[int, int, int, int]:
        """A rank's four figures, which depend on its place in the TP/PP/expert-TP and generation-TP groups only
        (computed once per place: a 1,024-rank mesh has a few dozen)."""
        own = (tp_rank / t, (tp_rank + 1) / t)
        own_experts = (etp_rank / x, (etp_rank + 1) / x)

        split, rep, experts = on_stage[pp_rank]

        def held(j: int) -> float:
            gen = (j / t_g, (j + 1) / t_g)
            return split * interval_overlap(own, gen) + experts / ep * interval_overlap(own_experts, gen) + rep

        own_size = split / t + experts / (ep * x) + rep
        return (round((gen_size - held(gen_tp_index)) * p_bytes),
                round((gen_size - max(held(j) for j in range(t_g))) * p_bytes),
                round(model - own_size * p_bytes), round(gen_size * p_bytes))

    stage_ranks = mesh.world_size // p  # pp is megatron's slowest axis; a rank's TP rank is its index mod TP
    etp_ranks = [layout.slot_ranks(local)[2] for local in range(stage_ranks)]
    figures = [per_rank(rank % t, rank // stage_ranks, etp_ranks[rank % stage_ranks], groups.gen_tp_index[rank])
               for rank in range(mesh.world_size)]
    received, bound, naive, gen_sizes = (list(column) for column in zip(*figures))
    return ReshardTraffic(tuple(received), tuple(bound), tuple(naive), tuple(gen_sizes), model)


@dataclass(frozen=True)
class CrossPoolTraffic:
    """Bytes of one weight sync from the trainer pool to a disaggregated rollout pool.

    A rollout rank holds no weights, so it must receive its whole generation shard, and receives
    exactly that once (`reshard.cross_pool_plan`). The sending is spread over the training ranks,
    each sending only ranges it holds; `bytes_sent_even` is the even split of the total.
    """

    bytes_received: tuple[int, ...]  # per rollout rank (= its generation shard)
    bytes_sent_even: int  # per training rank, the total spread evenly
    model_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_received)


def cross_pool_traffic(shape: ModelShape, trainer_world: int, rollout_world: int, infer_tp: int,
                       dtype: str) -> CrossPoolTraffic:
    """Per-rank traffic of a cross-pool sync (KV-head replication and vocab padding ignored, as in
    `reshard_traffic`). Every replica of the rollout pool takes the whole model."""
    p_bytes = DTYPE_BYTES[dtype]
    norms = 2 * shape.hidden_size
    replicated = norms * shape.num_layers + shape.hidden_size  # the layers' norms and the final norm
    split = embedding_params(shape) + output_params(shape) + sum(
        shape.params_of_layer(layer) - norms for layer in range(shape.num_layers))
    shard = round((split / infer_tp + replicated) * p_bytes)
    received = tuple(shard for _ in range(rollout_world))
    return CrossPoolTraffic(received, -(-sum(received) // max(trainer_world, 1)), (split + replicated) * p_bytes)
