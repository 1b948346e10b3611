"""Worker groups: N Ray actors of one worker class, one per bundle of a resource pool, joined in one
torch.distributed group, driven by the controller with fail-fast calls.

Bring-up, in order (each step fails fast with the group and rank that broke it):
1. one actor per bundle (`PlacementGroupSchedulingStrategy`), constructed with its `RankContext`;
2. local ranks from the physical node each actor landed on (and, on GPU, CUDA_VISIBLE_DEVICES =
   the node's group GPUs, so device index == LOCAL_RANK as under torchrun);
3. rank 0 picks a free port on its node; all ranks `init_process_group` concurrently
   (`nccl` on GPU, `gloo` on CPU) with `process_group_timeout_s`; megatron's groups take the same.

The process-group timeout (the trainer passes `trainer.nccl_timeout_s`, 30 min by default) is a
backstop only: when a rank fails, the controller kills the whole group within seconds (see
gather), so no peer waits on it. It must exceed the longest legitimate wait inside a collective
(peers at a barrier while rank 0 alone writes a checkpoint or an HF export).

Calls name the worker method itself, not its name: `group.call_all(ColocatedPolicyWorker.setup, steps)`,
`group.call_by_dp(PolicyWorker.compute_log_prob, batch)`. The group checks that its worker
class has that very function (inherited counts), so a method of another worker class, a typo or a
string is refused with a TypeError before any rank is called.
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridrl.controller.base_worker import RankContext, Worker
from hybridrl.controller.dispatch import (
    RankCall,
    RankMesh,
    all_to_all,
    collect_from_output_ranks,
    dispatch_by_dp,
    dispatch_order,
    one_to_all,
    select_output_ranks,
)
from hybridrl.controller.gather import WorkerGroupError, execute_all, kill_actors, submit_all, wait_all
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.data.batch import Batch
from hybridrl.parallel.device_policy import DevicePolicy


class WorkerGroupClosedError(RuntimeError):
    """A call on a group that was shut down (explicitly, or after a failure tore it down)."""


WorkerMethod = Callable[..., Any]  # a function of the group's worker class, e.g. `CriticWorker.update_critic`


class PendingCall:
    """A group call started with `WorkerGroup.submit_*`: the ranks run it while the controller goes on.

    `result()` waits for it fail-fast, like a blocking call (a failure tears the group down and raises
    `WorkerGroupError`); `done()` asks without waiting. A group runs one call at a time per rank (Ray
    actors are sequential), so later calls on the group queue behind this one.
    """

    def __init__(self, group: WorkerGroup, method: str, refs: list[Any], finish: Callable[[list[Any]], Any]) -> None:
        self.group = group
        self.method = method
        self.refs = refs
        self._finish = finish
        self._value: Any = None
        self._collected = False

    def done(self) -> bool:
        if self._collected:
            return True
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def failed(self) -> bool:
        """Whether some rank already failed (without waiting for the others)."""
        if self._collected:
            return False
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                return True
            except Exception:  # noqa: BLE001 - not ready after all: no failure seen
                continue
        return False

    def result(self) -> Any:
        if not self._collected:
            self._value = self._finish(self.group._wait(self.method, self.refs))
            self._collected = True
        return self._value


def worker_method_name(worker_cls: type, method: WorkerMethod, group: str) -> str:
    """`method.__name__`, when `worker_cls` has that very function (its own or inherited); else TypeError.

    Refused: a name string, a method of another worker class (`CriticWorker.update_critic` on the
    actor group), anything that is not a function of the class. Nothing is sent to a rank then.
    """
    cls = worker_cls.__name__
    if isinstance(method, str):
        raise TypeError(f"{group} group: pass the worker method itself ({cls}.{method}), not its name")
    name = getattr(method, "__name__", None)
    if not callable(method) or not isinstance(name, str):
        raise TypeError(f"{group} group: {method!r} is not a method of {cls}")
    if getattr(worker_cls, name, None) is not method:
        qualname = getattr(method, "__qualname__", name)
        owner = qualname.rpartition(".")[0] or getattr(method, "__module__", "?")
        hint = f": {cls} has its own {name}, call {cls}.{name}" if hasattr(worker_cls, name) else ""
        raise TypeError(f"{qualname} is a method of {owner}, not of {cls} (the {group} group's worker class){hint}")
    return name


def wait_together(calls: Sequence[PendingCall], poll_s: float = 0.5) -> list[Any]:
    """The results of calls running at once on different groups (two pools in one collective, e.g. a
    weight sync across them). Fail-fast across the groups: when one group's call fails, its error is
    raised and every other group of `calls` is torn down too (its ranks may be stuck in a collective
    with the failed ones)."""
    try:
        while not all(call.done() for call in calls):
            for call in calls:
                if call.failed():
                    call.result()  # raises WorkerGroupError, its group torn down
            refs = [ref for call in calls if not call.done() for ref in call.refs]
            if refs:  # wake when one more rank finishes (or fails), or after poll_s
                finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                ray.wait(refs, num_returns=min(len(finished) + 1, len(refs)), timeout=poll_s)
        return [call.result() for call in calls]
    except BaseException:
        for call in calls:
            call.group.shutdown()
        raise


def worker_process_env(policy: DevicePolicy) -> dict[str, str]:
    """The device's environment for worker processes (`DevicePolicy.worker_env`), less the variables
    the user has set: the workers of a local cluster inherit the user's own values."""
    return {name: value for name, value in policy.worker_env if name not in os.environ}


class WorkerGroup:
    """The actors of one worker group (`name`, a `GroupName`). Calls go to every rank; see `call_all`,
    `call_per_rank`, `call_by_dp`."""

    def __init__(
        self,
        worker_cls: type[Worker],
        pool: ResourcePool,
        *,
        name: str,
        worker_args: Sequence[Any] = (),
        worker_kwargs: dict[str, Any] | None = None,
        init_distributed: bool = True,
        process_group_timeout_s: float = 300.0,
        startup_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        poll_s: float = 0.5,
        restart: int = 0,
    ) -> None:
        if not isinstance(worker_cls, type) or not issubclass(worker_cls, Worker):
            # A `ray.remote` class hides the methods calls are checked against (worker_method_name).
            raise TypeError(f"{name} group: worker_cls must be a plain Worker subclass (WorkerGroup makes it a "
                            f"Ray actor itself), got {worker_cls!r}")
        self.name = name
        self.worker_cls: type[Worker] = worker_cls
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self.poll_s = poll_s
        self.mesh: RankMesh | None = None
        self._failure: WorkerGroupError | None = None
        self._closed = False
        # Called in every poll slice of this group's waits: the controller sets it to raise when another
        # group it drives at the same time has failed (a disaggregated rollout pool running ahead).
        self.watchdog: Callable[[], None] | None = None
        resources = pool.reserve(name)
        try:
            actor_cls = ray.remote(worker_cls)
            world = pool.world_size
            process_env = worker_process_env(pool.device_policy)
            self.actors: list[ActorHandle] = []
            self.node_addresses: list[str] = []
            for rank in range(world):
                placement_group, bundle = pool.locate(rank)
                context = RankContext(
                    group=name, rank=rank, world_size=world, node_rank=rank // pool.workers_per_node,
                    local_rank=bundle, local_world_size=pool.workers_per_node, use_gpu=pool.use_gpu,
                    restart=restart,
                )
                self.actors.append(
                    actor_cls.options(
                        num_cpus=resources.num_cpus,
                        num_gpus=resources.num_gpus,
                        runtime_env={"env_vars": process_env} if process_env else None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=placement_group, placement_group_bundle_index=bundle,
                        ),
                    ).remote(context, *worker_args, **(worker_kwargs or {}))
                )
            self._assign_local_ranks(startup_timeout_s)
            if init_distributed:
                self._init_distributed(process_group_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def placement_line(self) -> str:
        """Which ranks each node holds, by node address (`node_addresses`), in one line."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank, address in enumerate(self.node_addresses):
            by_node[address].append(rank)
        nodes = "; ".join(f"{address} {rank_ranges(ranks)}" for address, ranks in by_node.items())
        return f"{self.name} (pool {self.pool.name}): {self.world_size} rank(s) on {len(by_node)} node(s): {nodes}"

    # -------------------------------------------------------------------------- bring-up
    def _assign_local_ranks(self, startup_timeout_s: float) -> None:
        # The first call of every actor: a constructor exception shows up here as a dead actor.
        placements = self._execute("placement", one_to_all(world_size=self.world_size), startup_timeout_s)
        ranks_by_node: dict[str, list[int]] = defaultdict(list)
        for rank, (node_id, _, _) in enumerate(placements):
            ranks_by_node[node_id].append(rank)
        self.node_addresses = [address for _, _, address in placements]  # rank -> its node's address
        calls = [RankCall()] * self.world_size
        for ranks in ranks_by_node.values():
            devices = [device for r in ranks for device in placements[r][1][:1]]
            for local_rank, rank in enumerate(ranks):
                calls[rank] = RankCall((local_rank, len(ranks), devices))
        self._execute("set_local_placement", calls)

    def _init_distributed(self, timeout_s: float) -> None:
        dist_backend = self.pool.device_policy.dist_backend
        master_addr, master_port = self._execute_on(0, "pick_master_address")
        self._execute(
            "init_process_group",
            one_to_all(master_addr, master_port, dist_backend, timeout_s, world_size=self.world_size),
            timeout_s=timeout_s + 30.0,
        )

    # ---------------------------------------------------------------------------- calling
    def method_name(self, method: WorkerMethod) -> str:
        """The name to call `method` by on the actors, once it is known to be the worker class's own."""
        return worker_method_name(self.worker_cls, method, self.name)

    def _check_usable(self) -> None:
        if self._closed:
            reason = f" after a failure:\n{self._failure}" if self._failure else ""
            raise WorkerGroupClosedError(f"{self.name} worker group is shut down{reason}")

    def _execute(self, method: str, calls: Sequence[RankCall], timeout_s: float | None = None) -> list[Any]:
        self._check_usable()
        return self._wait(method, submit_all(self.actors, method, calls), timeout_s)

    def _wait(self, method: str, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        self._check_usable()
        try:
            return wait_all(
                refs, self.actors, group=self.name, method=method,
                timeout_s=timeout_s if timeout_s is not None else self.call_timeout_s, poll_s=self.poll_s,
                on_poll=self.watchdog,
            )
        except WorkerGroupError as error:
            error.locate(self.node_addresses)
            # wait_all already killed the actors; free the pool slot too.
            self._failure = error
            self.shutdown()
            raise

    def _execute_on(self, rank: int, method: str, *args: Any) -> Any:
        """One rank only, still fail-fast (a dead rank raises WorkerGroupError)."""
        return self._execute_subset([rank], method, RankCall(args))[0]

    def _execute_subset(self, ranks: Sequence[int], method: str, call: RankCall) -> list[Any]:
        self._check_usable()
        try:
            return execute_all(
                [self.actors[r] for r in ranks], method, [call] * len(ranks), group=self.name,
                timeout_s=self.call_timeout_s, poll_s=self.poll_s, tear_down_on_failure=False,
            )
        except WorkerGroupError as error:
            kill_actors(self.actors)
            self._failure = error
            self.shutdown()
            raise

    def execute_all(
        self, method: WorkerMethod, calls: Sequence[RankCall], timeout_s: float | None = None
    ) -> list[Any]:
        """`method` on every rank with calls[rank]; results in rank order. Fails fast, see gather."""
        return self._execute(self.method_name(method), calls, timeout_s)

    def call_all(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> list[Any]:
        """The same arguments to every rank (one-to-all); results in rank order."""
        return self.submit_all(method, *args, **kwargs).result()

    def call_per_rank(self, method: WorkerMethod, per_rank_args: Sequence[RankCall | tuple]) -> list[Any]:
        """Arguments per rank (all-to-all); results in rank order."""
        return self.submit_per_rank(method, per_rank_args).result()

    def call_by_dp(self, method: WorkerMethod, batch: Batch, *args: Any, mesh: RankMesh | None = None,
                   balance_mini_batches: int | None = None, keep_together: str | None = None, **kwargs: Any) -> Batch:
        """Split `batch` by DP rank, run `method(chunk, *args, **kwargs)` on every rank, and return
        the output ranks' batches concatenated in the original row order.

        `mesh` defaults to the group's training mesh; the colocated policy passes its rollout mesh
        (DP = vLLM replicas, TP = inference TP) for generation, whose layout differs.
        A batch that does not divide by the DP size is padded by repeating rows, and the padding
        rows are dropped from the result. `balance_mini_batches=k` dispatches the rows in
        `balanced_dp_order(tokens, dp, k)` (equal rows and balanced real tokens per rank, each of k
        mini-batches keeping its rows; `trainer.balance_batch`); the result is still in `batch`'s order.
        `keep_together` names a non-tensor column (`uid`) whose equal values the balanced order deals in whole
        groups where it can (`balanced_dp_order`'s `groups`: rows sharing a prompt, `model.shared_prefix`).
        """
        return self.submit_by_dp(method, batch, *args, mesh=mesh, balance_mini_batches=balance_mini_batches,
                                 keep_together=keep_together, **kwargs).result()

    def call_by_dp_outputs(self, method: WorkerMethod, batch: Batch, *args: Any, mesh: RankMesh | None = None,
                           balance_mini_batches: int | None = None, keep_together: str | None = None,
                           **kwargs: Any) -> list[Any]:
        """Like `call_by_dp` for methods that return something other than a batch (e.g. metrics):
        the output ranks' results, one per DP rank, in DP order. `batch` must divide by the DP size."""
        return self.submit_by_dp_outputs(method, batch, *args, mesh=mesh, balance_mini_batches=balance_mini_batches,
                                         keep_together=keep_together, **kwargs).result()

    # --------------------------------------------------------------------------- non-blocking
    # The calls above are these, waited for: `submit_*` starts the ranks and returns a `PendingCall`
    # at once, so the controller can drive two groups at the same time (a disaggregated rollout).
    def submit_all(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> PendingCall:
        name = self.method_name(method)
        self._check_usable()
        refs = submit_all(self.actors, name, one_to_all(*args, world_size=self.world_size, **kwargs))
        return PendingCall(self, name, refs, lambda results: results)

    def submit_per_rank(self, method: WorkerMethod, per_rank_args: Sequence[RankCall | tuple]) -> PendingCall:
        name = self.method_name(method)
        self._check_usable()
        refs = submit_all(self.actors, name, all_to_all(per_rank_args, self.world_size))
        return PendingCall(self, name, refs, lambda results: results)

    def submit_by_dp(self, method: WorkerMethod, batch: Batch, *args: Any, mesh: RankMesh | None = None,
                     balance_mini_batches: int | None = None, keep_together: str | None = None,
                     **kwargs: Any) -> PendingCall:
        name = self.method_name(method)
        self._check_usable()
        mesh = mesh or self.require_mesh()
        padded, pad_count = batch.pad_to_multiple(mesh.dp_size)
        order = None if balance_mini_batches is None else dispatch_order(
            padded, mesh.dp_size, balance_mini_batches, keep_together)
        refs = self._submit_chunks(name, padded if order is None else padded.reorder(order), mesh, args, kwargs)

        def finish(results: list[Any]) -> Batch:
            rows = collect_from_output_ranks(results, mesh)
            if order is not None:  # row order[i] came back at position i
                rows = rows.reorder(np.argsort(order, kind="stable"))
            return rows.unpad(pad_count)

        return PendingCall(self, name, refs, finish)

    def submit_by_dp_outputs(self, method: WorkerMethod, batch: Batch, *args: Any, mesh: RankMesh | None = None,
                             balance_mini_batches: int | None = None, keep_together: str | None = None,
                             **kwargs: Any) -> PendingCall:
        name = self.method_name(method)
        self._check_usable()
        mesh = mesh or self.require_mesh()
        if len(batch) % mesh.dp_size:
            raise ValueError(f"{name}: {len(batch)} rows do not split over {mesh.dp_size} data-parallel ranks")
        if balance_mini_batches is not None:
            batch = batch.reorder(dispatch_order(batch, mesh.dp_size, balance_mini_batches, keep_together))
        refs = self._submit_chunks(name, batch, mesh, args, kwargs)
        return PendingCall(self, name, refs, lambda results: select_output_ranks(results, mesh))

    def _submit_chunks(self, name: str, batch: Batch, mesh: RankMesh, args: tuple, kwargs: dict) -> list[Any]:
        """Start `name(chunk, *args, **kwargs)` on every rank, the chunk of its DP rank."""
        shared = one_to_all(*args, world_size=1, **kwargs)[0]
        calls = [RankCall((ref, *shared.args), shared.kwargs) for ref in dispatch_by_dp(batch, mesh)]
        return submit_all(self.actors, name, calls)

    # ------------------------------------------------------------------------------- mesh
    def set_mesh(self, mesh: RankMesh) -> None:
        if mesh.world_size != self.world_size:
            raise ValueError(f"mesh has {mesh.world_size} ranks, {self.name} group has {self.world_size}")
        self.mesh = mesh

    def learn_mesh(self) -> RankMesh:
        """Ask every rank for `mesh_coords()` (after it set up its parallel state); store the mesh."""
        mesh = RankMesh.from_coords(self._execute("mesh_coords", one_to_all(world_size=self.world_size)))
        self.set_mesh(mesh)
        return mesh

    def require_mesh(self) -> RankMesh:
        if self.mesh is None:
            raise RuntimeError(f"{self.name} group has no mesh yet: call learn_mesh() or set_mesh() first")
        return self.mesh

    # --------------------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Kill the actors (Ray delivers the kills asynchronously) and give the pool slot back; later
        calls through this group raise WorkerGroupClosedError. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        kill_actors(getattr(self, "actors", []))
        self.pool.release(self.name)

    @property
    def alive(self) -> bool:
        return not self._closed

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def rank_ranges(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0-3', 'ranks 0-1, 4-5' for sorted `ranks`."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
