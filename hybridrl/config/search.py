"""`hybridrl plan --search`: the layouts of a job's cluster the plan predicts fastest.

The cluster (its GPUs in all), the model, the batch and the lengths stay the user's; the layout is free:

- the trained roles' TP (powers of two within a machine) and PP (divisors of the layer count up to 16), the
  critic and the reference taking the actor's (as verl's examples do), with sequence parallelism wherever TP > 1
  on GPUs (megatron's pairing; it only saves memory);
- vLLM's TP (powers of two within a machine);
- the placement: colocated, or a rollout pool of its own of an eighth, a quarter, ... seven eighths of the machines
  (one machine: of its GPUs), generating in turn with training (sync) or one step ahead (one_step_off; a user's
  fully_async stays fully_async);
- the memory savers, tried in order for each layout until one fits: none, the gradient buffers freed between
  updates, Adam's moments offloaded too, then each of those with full activation recompute (where none does not
  fit, all of them together are planned first: each only lowers memory, so where that does not fit, none does).

What stays the user's: a teacher's and a reward model's layouts (the plan's memory refusal names the smallest
split of one that fits), context parallelism, VPP (where there is a pipeline; a PP their VPP does not divide is
tried without virtual stages), expert parallelism, the micro-batch sizes (the roofline has no model of a kernel's
efficiency against its batch, so it would always pick the smallest), dtypes, the algorithm.

Every candidate is planned as `hybridrl plan` plans a job (`build_plan`: every validation rule, the memory check),
so what the search prints is a job `train` accepts; the refused ones are counted by the field refused first. The
predicted step time (`config.step_time`) ranks what plans. A large search plans its layouts in forked processes, one
per core (`PARALLEL_FROM_LAYOUTS`): the same result as one process, sooner.
"""
from __future__ import annotations

import copy
import itertools
import multiprocessing
import os
import shlex
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import yaml

from hybridrl.config.checker import Checker
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.hardware import SHIPPED, Hardware, load_job_hardware
from hybridrl.config.loader import load_config_collecting, override_fields
from hybridrl.config.model_shapes import load_model_shape
from hybridrl.config.plan import MEMORY_REFUSAL_FIELD, Plan, build_plan, powers_of_two_upto, value_at
from hybridrl.config.resolve import resolve
from hybridrl.config.rollout_rules import FULLY_ASYNC_FIELDS
from hybridrl.config.schema import JobConfig, MegatronConfig
from hybridrl.config.step_time import StepTime, predict_step_time
from hybridrl.models.arch import ModelShape
from hybridrl.names import Role

# A setting the search chooses: (dotted config path, value).
Setting = tuple[str, object]

MAX_PIPELINE_STAGES = 16
# the rollout pool's share of the cluster's machines (one machine: of its GPUs) a disaggregated layout tries
ROLLOUT_SHARES = tuple(k / 8 for k in range(1, 8))  # eighths: 16 machines split 2 by 2, 128 by 16
# memory savers, least time lost first: (grad_offload, optimizer_offload, full recompute). Freeing the gradient
# buffers costs nothing (they are reallocated zeroed); the moments' copies cost PCIe time; recompute a forward.
SAVERS = ((False, False, False), (True, False, False), (True, True, False),
          (False, False, True), (True, False, True), (True, True, True))


@dataclass(frozen=True)
class Layout:
    """One point of the search space (the memory savers are chosen per layout, `SAVERS`)."""

    train_tp: int
    train_pp: int
    rollout_tp: int
    rollout_gpus: int  # 0: colocated
    async_mode: str


@dataclass(frozen=True)
class Found:
    """A layout that plans, with its memory savers, the settings that differ from the job's and the plan's
    predictions."""

    layout: Layout
    savers: tuple[bool, bool, bool]
    changes: tuple[Setting, ...]
    step: StepTime
    peak_gib: float
    train_dp: int
    rollout_replicas: int

    def overrides(self) -> list[str]:
        """The changes as `hybridrl plan` / `train` command-line overrides."""
        return [f"{path}={_override_value(value)}" for path, value in self.changes]


def _override_value(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def job_overrides(user_overrides: Sequence[str], found: Found) -> list[str]:
    """The command line's overrides of `found` as a job: the user's own (the search ran on them: the hardware, a
    batch size, ...), less the fields the layout changes, then the layout's. A user's override of a changed field is
    dropped whatever its spelling (a role-level layout field beside the layout's `.megatron.` one would be a
    conflict); a mapping override that sets one is written out field by field without it."""
    changed = {path for path, _ in found.changes}
    out: list[str] = []
    for override in user_overrides:
        fields = override_fields(override)
        if not any(path in changed for path, _ in fields):
            out.append(override)
            continue
        out += [f"{path}={_yaml_value(value)}" for path, value in fields if path not in changed]
    return out + found.overrides()


def _yaml_value(value: object) -> str:
    """A value as an override's YAML text that the loader reads back as `value`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("...").strip()


def job_command(config_path: str | None, user_overrides: Sequence[str], found: Found) -> str:
    """`hybridrl plan` of `found` as a job, for a shell: what the search planned, the model's config.json alone
    (`--layout-only`; `hybridrl train` takes the same config and overrides)."""
    words = ["hybridrl", "plan", "--layout-only", *([config_path] if config_path else []),
             *job_overrides(user_overrides, found)]
    return " ".join(shlex.quote(word) for word in words)


@dataclass(frozen=True)
class SearchResult:
    hardware: str
    total_gpus: int
    layouts: int        # points of the search space
    planned: int        # `build_plan` calls (a layout's savers tried in turn)
    refused: tuple[tuple[str, int], ...]  # (the field refused first, layouts) most common first
    ranked: tuple[Found, ...]  # every layout that plans, fastest first
    seconds: float
    written: Found | None  # the job's own layout, when it plans


def layouts(config: JobConfig, model: ModelShape) -> Iterator[Layout]:
    """Every layout of the job's cluster the search tries."""
    per_node = config.trainer.n_gpus_per_node
    nodes, total = cluster_size(config)
    tps = powers_of_two_upto(per_node)
    pps = [pp for pp in range(1, min(model.num_layers, MAX_PIPELINE_STAGES) + 1) if model.num_layers % pp == 0]
    ahead = "fully_async" if config.actor_rollout_ref.rollout.async_mode == "fully_async" else "one_step_off"
    unit = per_node if nodes > 1 else 1
    pools = sorted({max(1, round(share * (nodes if nodes > 1 else per_node))) * unit for share in ROLLOUT_SHARES})
    placements = [(0, "sync")] + [(gpus, mode) for gpus in pools if gpus < total for mode in ("sync", ahead)]
    for tp, pp, rollout_tp, (gpus, mode) in itertools.product(tps, pps, tps, placements):
        yield Layout(tp, pp, rollout_tp, gpus, mode)


def cluster_size(config: JobConfig) -> tuple[int, int]:
    """(machines, GPUs) of the whole job: the trainer's pool and a disaggregated rollout pool's."""
    trainer, rollout = config.trainer, config.actor_rollout_ref.rollout
    nodes, total = trainer.nnodes, trainer.nnodes * trainer.n_gpus_per_node
    if rollout.mode == "disaggregated" and rollout.n_gpus_per_node:
        total += rollout.nnodes * rollout.n_gpus_per_node
        nodes += rollout.nnodes if rollout.n_gpus_per_node == trainer.n_gpus_per_node else 0
    return nodes, total


VPP_FIELD = ".virtual_pipeline_model_parallel_size"


def settings_of(config: JobConfig, layout: Layout, savers: tuple[bool, bool, bool], critic: bool, *,
                keep_vpp: bool = True) -> list[Setting]:
    """The dotted settings that turn the user's job into `layout` with `savers` (`keep_vpp=False`: a pipeline
    without the user's virtual stages, which that PP refuses)."""
    per_node = config.trainer.n_gpus_per_node
    _, total = cluster_size(config)
    grads, optimizer, recompute = savers
    arr = "actor_rollout_ref"
    sections = [f"{arr}.actor.megatron"] + ([f"{arr}.ref.megatron"] if config.actor_rollout_ref.ref.megatron else [])
    trained = [f"{arr}.actor.megatron"] + (["critic.megatron"] if critic else [])
    out: list[Setting] = []
    for section in sections + (["critic.megatron"] if critic else []):
        written = _section(config, section)
        same_pp = layout.train_pp == written.pipeline_model_parallel_size
        out += [(f"{section}.tensor_model_parallel_size", layout.train_tp),
                (f"{section}.pipeline_model_parallel_size", layout.train_pp),
                # the user's VPP where there is a pipeline it divides; their uneven split at their PP only
                (f"{section}{VPP_FIELD}",
                 written.virtual_pipeline_model_parallel_size if layout.train_pp > 1 and keep_vpp else None),
                (f"{section}.num_layers_in_first_pipeline_stage",
                 written.num_layers_in_first_pipeline_stage if same_pp else None),
                (f"{section}.num_layers_in_last_pipeline_stage",
                 written.num_layers_in_last_pipeline_stage if same_pp else None)]
    sequence_parallel = layout.train_tp > 1 and config.trainer.device == "cuda"
    out += [(f"{section}.sequence_parallel", sequence_parallel) for section in sections + trained[1:]]
    out += [(f"{section}.{name}", value) for section in trained
            for name, value in (("grad_offload", grads), ("optimizer_offload", optimizer))]
    out.append((f"{arr}.model.enable_gradient_checkpointing", recompute))
    if critic:
        out.append(("critic.model.enable_gradient_checkpointing", recompute))
    rollout = f"{arr}.rollout"
    out.append((f"{rollout}.tensor_model_parallel_size", layout.rollout_tp))
    if layout.rollout_gpus == 0:
        nodes, gpus = (total // per_node, per_node) if total % per_node == 0 else (1, total)
        out += [("trainer.nnodes", nodes), ("trainer.n_gpus_per_node", gpus), (f"{rollout}.mode", "colocated"),
                (f"{rollout}.nnodes", 1), (f"{rollout}.n_gpus_per_node", None), (f"{rollout}.async_mode", "sync")]
    else:
        whole_nodes = layout.rollout_gpus % per_node == 0 and total % per_node == 0
        train_gpus = total - layout.rollout_gpus
        out += [("trainer.nnodes", train_gpus // per_node if whole_nodes else 1),
                ("trainer.n_gpus_per_node", per_node if whole_nodes else train_gpus),
                (f"{rollout}.mode", "disaggregated"),
                (f"{rollout}.nnodes", layout.rollout_gpus // per_node if whole_nodes else 1),
                (f"{rollout}.n_gpus_per_node", per_node if whole_nodes else layout.rollout_gpus),
                (f"{rollout}.async_mode", layout.async_mode), (f"{rollout}.free_cache_engine", None)]
    fully_async = layout.async_mode == "fully_async"
    out += [(f"{rollout}.{name}", getattr(config.actor_rollout_ref.rollout, name) if fully_async else None)
            for name in FULLY_ASYNC_FIELDS]
    return out


def _section(config: JobConfig, path: str) -> MegatronConfig:
    section = value_at(config, path)
    assert isinstance(section, MegatronConfig)
    return section


def with_settings(config: JobConfig, settings: list[Setting] | tuple[Setting, ...]) -> JobConfig:
    """`config` with each dotted path set: the sections on a set path are copied, the others shared (a deep copy
    per candidate would be most of the search's time)."""
    out = copy.copy(config)
    copied: set[str] = {""}
    for path, value in settings:
        *parents, name = path.split(".")
        section, where = out, ""
        for part in parents:
            child, where = getattr(section, part), f"{where}.{part}"
            if where not in copied:
                child = copy.copy(child)
                setattr(section, part, child)
                copied.add(where)
            section = child
        setattr(section, name, value)
    return out


# A search over at least this many layouts plans them in forked processes, one per core up to `MAX_SEARCH_PROCESSES`
# (each plan is ~0.5 ms of Python: 1,680 layouts took 0.9 s on one core); fewer, the forks would cost more than
# they save.
PARALLEL_FROM_LAYOUTS = 256
MAX_SEARCH_PROCESSES = 8


@dataclass(frozen=True)
class _Searched:
    """What planning some of the layouts gave: each by its place in `layouts`' order."""

    found: list[tuple[int, Found]]
    refused: list[tuple[int, str]]  # (place, the field refused first)
    planned: int


# The search a forked process plans a share of: set by the parent before it forks (inherited, not pickled).
_FORKED_SEARCH: tuple[JobConfig, JobConfig, Hardware, bool] | None = None


def search(config: JobConfig, model: ModelShape, hardware: Hardware, *, critic: bool,
           overrides_of: JobConfig | None = None, processes: int | None = None) -> SearchResult:
    """Plan every layout (`layouts`) of `config`'s cluster, each with the first memory savers that fit, and rank
    what plans by the predicted step time on `hardware`; each layout's overrides turn `overrides_of` (default
    `config`: a sizing searches a resized copy of the user's job) into it. `processes`: how many processes plan the
    layouts (None: one per core for a search of `PARALLEL_FROM_LAYOUTS` or more, where this process may fork); the
    result is the same whatever the number."""
    started = time.perf_counter()
    base = copy.deepcopy(config)  # every candidate's unchanged sections (the user's object stays theirs)
    candidates = list(enumerate(layouts(config, model)))
    try:  # planned first: the caches it fills (the model's per-layer counts, meshes) are each forked process's too
        own = build_plan(config)
        written = _found(own, hardware, layout_of(own), savers_of(own), config)
    except ConfigError:
        written = None
    count = processes if processes is not None else _search_processes(len(candidates))
    if count > 1:
        global _FORKED_SEARCH
        _FORKED_SEARCH = (config, base, hardware, critic)
        try:
            with multiprocessing.get_context("fork").Pool(count) as pool:
                parts = pool.map(_search_share, [(candidates[k::count], overrides_of) for k in range(count)])
        finally:
            _FORKED_SEARCH = None
    else:
        parts = [_plan_layouts(config, base, hardware, critic, candidates, overrides_of)]
    refused: Counter[str] = Counter()
    for _, field in sorted(item for part in parts for item in part.refused):
        refused[field] += 1  # counted in the layouts' order: ties rank as one process ranks them
    found = sorted((item for part in parts for item in part.found), key=lambda item: item[0])
    ranked = tuple(sorted((f for _, f in found), key=lambda f: (f.step.seconds, f.peak_gib)))
    return SearchResult(hardware.name, cluster_size(config)[1], len(candidates), sum(p.planned for p in parts),
                        tuple(refused.most_common()), ranked, time.perf_counter() - started, written)


def _search_processes(layout_count: int) -> int:
    """Processes for a search of `layout_count` layouts: one per core this process may run on (at most
    `MAX_SEARCH_PROCESSES`) from `PARALLEL_FROM_LAYOUTS` layouts on; one where forking is unsafe or impossible (a
    process running threads: a fork copies the locks they hold; a daemon process, which may not have children)."""
    if layout_count < PARALLEL_FROM_LAYOUTS or not hasattr(os, "fork") or threading.active_count() > 1 \
            or multiprocessing.current_process().daemon:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_SEARCH_PROCESSES))


def _search_share(job: tuple[list[tuple[int, Layout]], JobConfig | None]) -> _Searched:
    """A forked process's share of the layouts (`_FORKED_SEARCH` holds the rest of the search)."""
    assert _FORKED_SEARCH is not None, "set by search() before it forks"
    config, base, hardware, critic = _FORKED_SEARCH
    share, overrides_of = job
    return _plan_layouts(config, base, hardware, critic, share, overrides_of)


def _plan_layouts(config: JobConfig, base: JobConfig, hardware: Hardware, critic: bool,
                  candidates: list[tuple[int, Layout]], overrides_of: JobConfig | None) -> _Searched:
    """Plan each of `candidates` (its place, the layout) with the first memory savers that fit."""
    refused: list[tuple[int, str]] = []
    found: list[tuple[int, Found]] = []
    planned = 0
    unvirtual: set[int] = set()  # the PPs the user's VPP does not divide (its rules read PP and the layers alone)

    def plan_with(layout: Layout, savers: tuple[bool, bool, bool], keep_vpp: bool) -> tuple[Plan, list[Setting]]:
        nonlocal planned
        planned += 1
        settings = settings_of(config, layout, savers, critic, keep_vpp=keep_vpp)
        return build_plan(with_settings(base, settings), handed_over=True, refuse_over_memory=False), settings

    for place, layout in candidates:
        keep_vpp = layout.train_pp not in unvirtual
        try:
            try:
                plan, settings = plan_with(layout, SAVERS[0], keep_vpp)
            except ConfigError as exc:
                if not (keep_vpp and layout.train_pp > 1 and all(i.field.endswith(VPP_FIELD) for i in exc.issues)):
                    raise
                keep_vpp = False  # the user's VPP does not divide this pipeline: the pipeline without it
                unvirtual.add(layout.train_pp)
                plan, settings = plan_with(layout, SAVERS[0], keep_vpp)
        except ConfigError as exc:
            refused.append((place, exc.issues[0].field))  # a rule, not memory: no saver changes it
            continue
        tried = {SAVERS[0]: (plan, settings)}
        if not _fits(plan):
            # each saver only lowers a GPU's memory, so all of them together hold the least: where that does not
            # fit, none does (one plan instead of five)
            tried[SAVERS[-1]] = plan_with(layout, SAVERS[-1], keep_vpp)
            if not _fits(tried[SAVERS[-1]][0]):
                refused.append((place, MEMORY_REFUSAL_FIELD))
                continue
        for savers in SAVERS:  # the first that fits, least time lost first
            plan, settings = tried[savers] if savers in tried else plan_with(layout, savers, keep_vpp)
            if _fits(plan):
                found.append((place, _found(plan, hardware, layout, savers, overrides_of or config, settings)))
                break
    return _Searched(found, refused, planned)


def _fits(plan: Plan) -> bool:
    """Whether a candidate's GPUs hold it (a device whose memory budget is not binding holds any)."""
    return plan.gpu_memory is None or plan.gpu_memory.fits or not plan.device_policy.gpu_memory_budget_binding


def layout_of(plan: Plan) -> Layout:
    """A planned job's point in the search space."""
    actor = plan.layout(Role.ACTOR).mesh
    rollout = plan.config.actor_rollout_ref.rollout
    return Layout(actor.tp, actor.pp, rollout.tensor_model_parallel_size, plan.resolved.rollout_world
                  if plan.resolved.disaggregated else 0, plan.resolved.async_mode)


def savers_of(plan: Plan) -> tuple[bool, bool, bool]:
    mc = plan.layout(Role.ACTOR).megatron
    return (mc.grad_offload, mc.optimizer_offload, plan.config.actor_rollout_ref.model.enable_gradient_checkpointing)


def _found(plan: Plan, hardware: Hardware, layout: Layout, savers: tuple[bool, bool, bool],
           written: JobConfig, settings: list[Setting] | tuple[Setting, ...] = ()) -> Found:
    step = predict_step_time(plan, hardware)
    assert step is not None  # the search runs with a model shape
    changes = tuple((path, value) for path, value in settings if value_at(written, path) != value)
    return Found(layout, savers, changes, step, plan.gpu_memory.peak_gib if plan.gpu_memory else 0.0,
                 plan.layout(Role.ACTOR).mesh.dp, plan.reshard.groups.rollout.infer_dp)


@dataclass(frozen=True)
class SearchInputs:
    config: JobConfig
    model: ModelShape
    hardware: Hardware
    critic: bool


def search_inputs(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> SearchInputs:
    """Load the job (the loader's problems refused, as `hybridrl plan` refuses them), its `trainer.hardware` and its
    model's shape. The layout's own fields may be wrong: the search replaces them."""
    config, issues = load_config_collecting(path, overrides)
    if issues:
        raise ConfigError(issues)
    # the cluster the search splits: a size below one GPU would search nothing and answer "no layout plans"
    check = Checker(issues, [])
    check.is_int_at_least("trainer.nnodes", config.trainer.nnodes, 1)
    check.is_int_at_least("trainer.n_gpus_per_node", config.trainer.n_gpus_per_node, 1)
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode == "disaggregated" and rollout.n_gpus_per_node is not None:  # its pool counts in the cluster
        check.is_int_at_least("actor_rollout_ref.rollout.nnodes", rollout.nnodes, 1)
        check.is_int_at_least("actor_rollout_ref.rollout.n_gpus_per_node", rollout.n_gpus_per_node, 1)
    if issues:
        raise ConfigError(issues)
    hardware_name = config.trainer.hardware
    if hardware_name is None:
        raise ConfigError([ConfigIssue("trainer.hardware", None, "is needed by --search, which ranks layouts by "
                                       "their predicted step time: name a GPU or a YAML file of its figures",
                                       list(SHIPPED))])
    hardware = load_job_hardware(hardware_name)
    field = "actor_rollout_ref.model.path"
    shape_issues: list[ConfigIssue] = []
    model = load_model_shape(config.actor_rollout_ref.model.path, shape_issues, [], field, quiet=True)
    if model is None:
        raise ConfigError(shape_issues or [ConfigIssue(field, config.actor_rollout_ref.model.path,
                                                       "has no config.json: --search sizes layouts from the model's "
                                                       "shape")])
    return SearchInputs(config, model, hardware, resolve(config, model).critic_enabled)


def search_from_sources(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> SearchResult:
    """`search` of the job at `path` with `overrides` on its `trainer.hardware` (`search_inputs`)."""
    inputs = search_inputs(path, overrides)
    return search(inputs.config, inputs.model, inputs.hardware, critic=inputs.critic)


# how far past the job's own machines a sizing looks (x the job's machines)
SIZING_GROWTH = 4


@dataclass(frozen=True)
class Sizing:
    """`hybridrl plan --search --target-step-time S`: the best layout of each cluster size tried, smallest first,
    and the smallest whose best meets the target (None: none tried does)."""

    target_s: float
    results: tuple[SearchResult, ...]
    smallest: SearchResult | None


def cluster_sizes(config: JobConfig) -> list[tuple[int, int]]:
    """(machines, GPUs per machine) a sizing tries: a part of one machine (halving its GPUs), then whole machines in
    powers of two up to `SIZING_GROWTH` x the job's."""
    per_node = config.trainer.n_gpus_per_node
    nodes, _ = cluster_size(config)
    parts = sorted({per_node >> i for i in range(1, per_node.bit_length()) if per_node >> i >= 1})
    wholes = powers_of_two_upto(max(1, nodes) * SIZING_GROWTH)
    return [(1, gpus) for gpus in parts] + [(machines, per_node) for machines in wholes]


def size_cluster(inputs: SearchInputs, target_s: float) -> Sizing:
    """Search the job on each of `cluster_sizes` (the batch, lengths and model the job's), smallest first, until one
    cluster's best layout predicts a step of at most `target_s` seconds."""
    results: list[SearchResult] = []
    for machines, gpus in cluster_sizes(inputs.config):
        sized = copy.deepcopy(inputs.config)
        sized.trainer.nnodes, sized.trainer.n_gpus_per_node = machines, gpus
        sized.actor_rollout_ref.rollout.mode = "colocated"  # the cluster is the trainer's; the search splits it
        result = search(sized, inputs.model, inputs.hardware, critic=inputs.critic, overrides_of=inputs.config)
        results.append(result)
        if result.ranked and result.ranked[0].step.seconds <= target_s:
            return Sizing(target_s, tuple(results), result)
    return Sizing(target_s, tuple(results), None)
