"""What crosses between machines in one training step, phase by phase: the plan's model of inter-node traffic.

Global rank r runs on node r // n_gpus_per_node (`controller.resource_pool`). Per node, the bytes its ranks
send to ranks on other nodes, for what a colocated step moves in bulk:

- `update_actor`, `update_critic`: megatron DDP's gradient reduction over each DP x CP group, once per optimizer
  step, fp32 (hybridrl reduces gradients in fp32): an all-reduce in which each rank sends 2(p-1)/p of its
  gradient buffer to the next rank of its group (gloo's and NCCL's ring; the distributed optimizer's
  reduce-scatter of the gradients plus all-gather of the parameters moves (p-1)/p of each). With tied
  embeddings at PP > 1 the first and last stages also all-reduce the embedding gradient. Then the pipeline:
  each micro-batch's activations forward and their gradients backward across every boundary between
  consecutive model chunks (VPP chunks included) whose two ranks are on different nodes: tokens x hidden
  values in the pipeline dtype each way (a TP rank sends its 1/TP of them with sequence parallelism, all of
  them without).
- `old_log_prob`, `ref`, `values`, `teacher`: the forward half of that, for each pass the step runs. A teacher on a
  pool of its own (`teacher.mode: disaggregated`) is on nodes of its own, after the training and rollout nodes,
  `teacher.n_gpus_per_node` ranks each: its pipeline crosses between those nodes.
- `sync`: what each rank receives in a weight sync (the plan's `reshard_traffic`, in vLLM's dtype) from the
  members of its micro-DP group on other nodes; with a disaggregated rollout, the whole cross-pool sync (the
  rollout pool on nodes of its own), each training rank sending an even share. When vLLM serves a LoRA actor's
  adapters (`lora.merge: false`) a step's sync moves the PEFT adapter alone (the base crossed once, at set-up):
  colocated, each stage's part is broadcast from its first holder to every rank, so each other node receives it
  once; disaggregated, training rank r ships the whole adapter to the rollout ranks q with q mod trainer_world = r
  (`reshard.adapter_sync`).

Not modelled (measured against this in tests/e2e/test_multi_host.py and named there): Ray's calls (the step's
rows to the workers and their results back, with the controller on the head node: a teacher's log-probs among
them, and full_reverse_kl's `[B, R, V]` table, bounded at plan time), the small collectives
(loss and grad-norm reductions, micro-batch token agreement), TCP/IP headers (a few percent on top), an MoE
model's token dispatch and expert gradients, vLLM's own collectives where a replica spans nodes, and the
reward model.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hybridrl.config.estimates import DTYPE_BYTES, embedding_params, stage_params
from hybridrl.config.meshes import ReshardGroups, TrainingMesh, adapter_receivers
from hybridrl.config.model_shapes import role_model_shape
from hybridrl.config.plan import Plan, served_adapter_bytes
from hybridrl.models.arch import ModelShape
from hybridrl.names import TIMED_PHASES, Phase, Role

GRAD_BYTES = 4  # gradients reduce in fp32


@dataclass(frozen=True)
class RoleTraffic:
    """One trained or forward-only role's inputs to the model: its mesh and what one step runs through it."""

    phase_update: Phase | None  # the update's phase (None: a forward-only role)
    forward_phases: tuple[Phase, ...]  # the forward-only passes it serves in a step
    shape: ModelShape
    mesh: TrainingMesh
    dtype: str  # parameters and pipeline activations
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    optimizer_steps: int = 0  # per training step
    update_epochs: int = 0  # forward + backward passes over the step's tokens
    tokens: float = 0.0  # the tokens a pass computes (a prompt shared by a micro-batch's rows once), all ranks
    # the role's pool: its first node and ranks per node (None: the training pool, from node 0, `per_node` a node)
    first_node: int = 0
    ranks_per_node: int | None = None

    def nodes(self, per_node: int) -> int:
        """The nodes the role's pool spans, counting from node 0."""
        return self.first_node + -(-self.mesh.world_size // (self.ranks_per_node or per_node))


@dataclass(frozen=True)
class NodeTraffic:
    """Bytes each node sends to the others in one step, per phase (`phases[name][node]`)."""

    nodes: int
    phases: dict[str, tuple[int, ...]]

    def total(self) -> tuple[int, ...]:
        return tuple(sum(sent[node] for sent in self.phases.values()) for node in range(self.nodes))


def _node_of(per_node: int, first_node: int = 0) -> Callable[[int], int]:
    return lambda rank: first_node + rank // per_node


def _ring(group: Sequence[int], bytes_per_rank: float, node_of: Callable[[int], int], out: list[float]) -> None:
    """An all-reduce of `bytes_per_rank` over `group` (ring, in rank order): each rank sends 2(p-1)/p of it to the
    next; counted where the next rank is on another node."""
    ranks = sorted(group)
    p = len(ranks)
    if p < 2:
        return
    for i, rank in enumerate(ranks):
        if node_of(rank) != node_of(ranks[(i + 1) % p]):
            out[node_of(rank)] += 2 * (p - 1) / p * bytes_per_rank


def _gradient_elements(role: RoleTraffic) -> list[float]:
    """Gradient elements one rank of each pipeline stage holds (megatron's padded vocabulary included; a tied
    embedding's copy on the last stage too)."""
    layout = role.mesh.layout()
    shape, tp, pp = role.shape, role.mesh.tp, role.mesh.pp
    stages = [dense + experts for dense, experts in stage_params(shape, layout)]
    padding = (shape.padded_vocab_size(tp) - shape.vocab_size) * shape.hidden_size / tp
    stages[0] += padding
    if not shape.tie_word_embeddings:
        stages[-1] += padding
    elif pp > 1:
        stages[-1] += (embedding_params(shape) / tp) + padding
    return stages


def _pipeline_hops(role: RoleTraffic, node_of: Callable[[int], int]) -> list[tuple[int, int, float]]:
    """(sending node, receiving node, bytes per token of the step) of each boundary between consecutive model
    chunks whose ranks are on different nodes: a DP/CP replica carries 1/(DP CP) of the step's tokens, and each
    TP rank sends its activations to its peer of the next chunk (1/TP of them with sequence parallelism)."""
    mesh = role.mesh
    per_token = (role.shape.hidden_size / (mesh.tp if role.sequence_parallel else 1) * DTYPE_BYTES[role.dtype]
                 / (mesh.dp * mesh.cp))
    virtual = mesh.pp * (mesh.vpp or 1)
    hops = []
    for dp in range(mesh.dp):
        for cp in range(mesh.cp):
            for tp in range(mesh.tp):
                for v in range(virtual - 1):
                    src = node_of(mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=v % mesh.pp))
                    dst = node_of(mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=(v + 1) % mesh.pp))
                    if src != dst:
                        hops.append((src, dst, per_token))
    return hops


def _gradient_reduction(role: RoleTraffic, grads: Sequence[float], node_of: Callable[[int], int],
                        out: list[float]) -> None:
    """One optimizer step's gradient reduction over every DP group (and the tied embedding's at PP > 1); `grads`:
    `_gradient_elements(role)`."""
    mesh = role.mesh
    param_bytes = DTYPE_BYTES[role.dtype]
    for stage in range(mesh.pp):
        per_rank = grads[stage] * GRAD_BYTES
        if role.distributed_optimizer:  # reduce-scatter of the grads, all-gather of the params: (p-1)/p each
            per_rank = (per_rank + grads[stage] * param_bytes) / 2
        for tp in range(mesh.tp):  # megatron reduces gradients over DP x CP
            group = [mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=stage) for dp in range(mesh.dp) for cp in range(mesh.cp)]
            _ring(group, per_rank, node_of, out)
    if role.shape.tie_word_embeddings and mesh.pp > 1:
        embedding = embedding_params(role.shape) / mesh.tp * GRAD_BYTES
        for dp in range(mesh.dp):
            for cp in range(mesh.cp):
                for tp in range(mesh.tp):
                    ends = [mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=0), mesh.rank_of(tp=tp, cp=cp, dp=dp, pp=mesh.pp - 1)]
                    _ring(ends, embedding, node_of, out)


def _sync(role: RoleTraffic, stages: Sequence[float], groups: ReshardGroups, received: Sequence[int],
          node_of: Callable[[int], int], out: list[float]) -> None:
    """The weight sync between nodes. Rank r receives `received[r]` bytes (the plan's `reshard_traffic`), each part
    from the member of its micro-DP group that holds it (`reshard.reshard_plan`): with the plan's groups a member
    holding stage s gives a share proportional to stage s's parameters (its 1/TP of them at TP = k x infer TP,
    1/infer TP of them at infer TP = m x TP, of every tensor the same), so the part from other nodes is the share
    of those members' stages (`stages`: each stage's parameters, `_gradient_elements`)."""
    mesh = role.mesh
    for group in groups.micro_dp_groups:
        for rank in group:
            members = [m for m in group if m != rank]
            weights = {m: stages[mesh.coord(m).pp] for m in members}
            total = sum(weights.values())
            if not total:
                continue
            for member, weight in weights.items():
                if node_of(member) != node_of(rank):
                    out[node_of(member)] += received[rank] * weight / total


def _adapter_broadcast(role: RoleTraffic, adapter_bytes: float, node_of: Callable[[int], int],
                       out: list[float]) -> None:
    """A colocated sync of served adapters: each pipeline stage's adapter (its share of the layers), gathered over
    TP, is broadcast from its first holder (TP, DP and CP rank 0) to every rank: each other node receives it once."""
    mesh, layers = role.mesh, role.shape.num_layers
    layout = mesh.layout()
    nodes = len({node_of(rank) for rank in range(mesh.world_size)})
    for stage in range(mesh.pp):
        share = sum(len(chunk.layers) for chunk in layout.chunks(layers, stage)) / layers
        holder = node_of(mesh.rank_of(tp=0, cp=0, dp=0, pp=stage))
        out[holder] += adapter_bytes * share * (nodes - 1)


def internode_traffic(roles: Sequence[RoleTraffic], *, per_node: int,
                      sync: tuple[ReshardGroups, Sequence[int]] | None = None,
                      cross_pool: tuple[Sequence[float], int] | None = None,
                      served_adapter_bytes: float = 0.0) -> NodeTraffic:
    """Bytes each node sends to the others per phase of a step; `per_node` ranks per node. The weight sync:
    colocated (`sync`), the actor's reshard groups and the bytes each rank receives (the actor: the role whose
    update is `update_actor`), or with `served_adapter_bytes` (vLLM serves the adapters) the adapter's broadcast;
    disaggregated (`cross_pool`), the bytes each training rank sends and the rollout pool's nodes, which come after
    the training nodes (a pool of its own: every byte of the sync crosses)."""
    training = [role for role in roles if role.ranks_per_node is None]
    world = max(role.mesh.world_size for role in training)
    nodes = max([-(-world // per_node) + (cross_pool[1] if cross_pool else 0)]
                + [role.nodes(per_node) for role in roles])
    node_of = _node_of(per_node)
    phases: dict[str, list[float]] = {}

    def phase(name: Phase) -> list[float]:
        return phases.setdefault(str(name), [0.0] * nodes)

    for role in roles:
        hops = _pipeline_hops(role, _node_of(role.ranks_per_node or per_node, role.first_node))
        for name in role.forward_phases:
            for src, _dst, per_token in hops:
                phase(name)[src] += per_token * role.tokens
        if role.phase_update is not None:
            out = phase(role.phase_update)
            grads = _gradient_elements(role)
            one_step = [0.0] * nodes
            _gradient_reduction(role, grads, node_of, one_step)
            for node, sent in enumerate(one_step):  # the same reduction after every optimizer step
                out[node] += sent * role.optimizer_steps
            for src, dst, per_token in hops:  # activations forward, their gradients back
                out[src] += per_token * role.tokens * role.update_epochs
                out[dst] += per_token * role.tokens * role.update_epochs
            if role.phase_update == Phase.UPDATE_ACTOR and cross_pool is None:
                if served_adapter_bytes:
                    _adapter_broadcast(role, served_adapter_bytes, node_of, phase(Phase.SYNC))
                elif sync is not None:
                    _sync(role, grads, sync[0], sync[1], node_of, phase(Phase.SYNC))
    if cross_pool is not None:
        for rank, sent in enumerate(cross_pool[0]):
            phase(Phase.SYNC)[node_of(rank)] += sent
    order = [str(name) for name in TIMED_PHASES]
    return NodeTraffic(nodes, {name: tuple(round(b) for b in phases[name])
                               for name in sorted(phases, key=lambda name: order.index(name))})


def _pool_nodes(plan: Plan, role: str, rollout_nodes: int) -> tuple[int, int | None]:
    """RoleTraffic's (first_node, ranks_per_node): a teacher on a pool of its own starts after the training and
    rollout nodes; every other role is on the training pool."""
    if role != Role.TEACHER or not plan.resolved.teacher_world:
        return 0, None
    config = plan.config
    return (config.trainer.nnodes or 1) + rollout_nodes, config.teacher.n_gpus_per_node


def plan_internode_traffic(plan: Plan, tokens: Mapping[str, float] | None = None) -> NodeTraffic | None:
    """The model applied to a plan's step (None on one node or without a model shape). `tokens`: a role's tokens
    per pass where known (measured); by default the worst case, every sequence at full length, a prompt once per
    group of rows sharing it where the role's micro-batches hold shared prompts once (`model.shared_prefix`).
    A disaggregated rollout pool is on nodes of its own, after the training nodes; a teacher's pool after those."""
    resolved, config = plan.resolved, plan.config
    per_node = config.trainer.n_gpus_per_node
    traffic, cross = plan.reshard.traffic, plan.reshard.cross_pool
    rollout_nodes = (config.actor_rollout_ref.rollout.nnodes or 1) if resolved.disaggregated else 0
    teacher_nodes = (config.teacher.nnodes or 1) if resolved.teacher_world else 0
    if (plan.model is None or (config.trainer.nnodes or 1) + rollout_nodes + teacher_nodes < 2
            or not isinstance(per_node, int)):
        return None
    prompt_length = config.data.max_prompt_length
    forwards = {f.role: f.pass_name for f in plan.forwards}
    phase_of_pass = {"old_log_prob": Phase.OLD_LOG_PROB, "ref_log_prob": Phase.REF, "values": Phase.VALUES,
                     "teacher_log_prob": Phase.TEACHER}
    roles = []
    for layout in plan.layouts:
        if layout.role == Role.REWARD_MODEL:
            continue
        passes = [phase_of_pass[forwards[layout.role]]] if layout.role in forwards else []
        if layout.role == Role.ACTOR and not resolved.old_log_prob_pass:
            passes = []
        prompts = plan.prompts_per_step if resolved.shared_prefix(layout.role) else plan.sequences_per_step
        worst = prompts * prompt_length + plan.sequences_per_step * resolved.response_length
        update = next((u for u in plan.updates if u.role == layout.role), None)
        mc = layout.megatron
        pool = _pool_nodes(plan, layout.role, rollout_nodes)
        roles.append(RoleTraffic(
            phase_update={Role.ACTOR: Phase.UPDATE_ACTOR, Role.CRITIC: Phase.UPDATE_CRITIC}.get(layout.role),
            forward_phases=tuple(passes), shape=role_model_shape(config, layout.role, plan.model), mesh=layout.mesh,
            dtype=mc.dtype or resolved.train_dtype, sequence_parallel=bool(mc.sequence_parallel),
            distributed_optimizer=bool(mc.use_distributed_optimizer),
            optimizer_steps=update.optimizer_steps_per_step if update else 0,
            update_epochs=update.ppo_epochs if update else 0,
            tokens=(tokens or {}).get(layout.role, worst), first_node=pool[0], ranks_per_node=pool[1]))
    adapter = served_adapter_bytes(plan)
    cross_sent: list[float] = []
    if cross:
        trainers = plan.layout(Role.ACTOR).mesh.world_size
        cross_sent = ([adapter * len(adapter_receivers(r, trainers, resolved.rollout_world)) for r in range(trainers)]
                      if adapter else [cross.bytes_sent_even] * trainers)
    return internode_traffic(roles, per_node=per_node,
                             sync=(plan.reshard.groups, traffic.bytes_received) if traffic else None,
                             cross_pool=(cross_sent, rollout_nodes) if cross else None,
                             served_adapter_bytes=adapter)
