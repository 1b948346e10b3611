"""`hybridrl train CONFIG [overrides]`: plan (refusing a bad config before anything starts), then train."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridrl.config.errors import ConfigError
from hybridrl.config.loader import config_and_overrides
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import packing_line, resume_line
from hybridrl.config.schema import JobConfig
from hybridrl.persistence import atomic_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML job config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    parser.add_argument("--skip-version-check", action="store_true",
                        help="start even on a stack `hybridrl doctor` refuses (at your own risk)")


def run(args: argparse.Namespace) -> int:
    config_path, overrides = config_and_overrides(args.config, args.overrides)
    if config_path is None and not overrides:  # argparse would also call the optional overrides required
        print("hybridrl train: give the job's YAML config first (configs/examples/ has some), then any overrides "
              "(or every setting as overrides, as a verl script does)", file=sys.stderr)
        return 2
    try:
        plan = plan_from_sources(config_path, overrides, check_files=True)
    except ConfigError as exc:
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    # a default that depends on the device: say what it resolved to
    print(packing_line(plan), file=sys.stderr)
    print(resume_line(plan), file=sys.stderr)  # where it starts: a checkpoint the plan checked, or step 0

    # Refuse a known-bad stack before Ray starts: it would otherwise fail minutes later, in a worker.
    # lazy: versions loads importlib.metadata and packaging (~70 ms), and every `hybridrl` command
    # (`--help` included) imports this module to build its parser.
    from hybridrl.parallel.versions import check_stack, collect_versions, summary_line

    versions = collect_versions()
    print(summary_line(versions), file=sys.stderr)
    stack = check_stack(versions, plan.resolved.device)
    for warning in stack.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not stack.ok and not args.skip_version_check:
        problems = "\n".join(f"  - {p}" for p in stack.problems)
        print(f"hybridrl train: incompatible software stack for a {plan.resolved.device} job:\n{problems}",
              file=sys.stderr)
        return 2

    # lazy: the trainer imports torch and Ray; a refused config or stack answers without either.
    from hybridrl.controller.cluster import RayAddressError, check_ray_address
    from hybridrl.trainer.trainer import Trainer, TrainingFailure, run_dir_for

    # An existing cluster is checked before anything is written: ray.init alone retries an unreachable one for
    # many minutes (deaf to SIGTERM); this answers within seconds (unresolvable host, closed port) or ~30 s.
    configured = plan.config.trainer.ray_address
    address, field = (configured, "trainer.ray_address") if configured is not None else \
        (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    if address and address != "local":
        try:
            check_ray_address(address, field)
        except RayAddressError as exc:
            print(f"hybridrl train: {exc}", file=sys.stderr)
            return 2
    elif problem := _needs_a_cluster(plan.config, address):
        print(f"hybridrl train: {problem}", file=sys.stderr)
        return 2

    trainer = None
    stopped_by: list[int] = []  # Ray's `get` turns any exception a handler raises into a plain KeyboardInterrupt
    try:
        with stop_signals_interrupt(stopped_by):
            trainer = Trainer(plan, progress=not args.no_progress)
            result = trainer.fit()
    except ConfigError as exc:  # what only reading the user's files whole shows (a malformed row), before Ray
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or a `Stopped` (the signal in `stopped_by`): fit's clean-up has run
        signum = stopped_by[0] if stopped_by else signal.SIGINT
        name = signal.Signals(signum).name
        report = trainer.stop_report(name) if trainer is not None else f"stopped by {name} before the run started"
        print(f"hybridrl train: {report}", file=sys.stderr)
        return 128 + signum  # the shell's convention for a process ended by a signal
    except Exception as exc:  # noqa: BLE001 - a run-time failure: one line here, the whole story in a file
        if trainer is not None and _disk_refused(exc):  # the controller's own files (metrics, a checkpoint's state)
            print(f"hybridrl train: could not write {trainer.where()}: {exc} (the run folder is {trainer.run_dir}, "
                  f"the checkpoints go under {trainer.checkpoints.root}); {trainer.resume_hint()}", file=sys.stderr)
            return 1  # the line is the whole story: no failure.log for the disk to refuse too
        # TrainingFailure: step, phase, role, rank and cause (workers already torn down); anything else is
        # hybridrl's bug or the machine's, and its traceback goes to the file too.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cause = first if isinstance(exc, TrainingFailure) else f"{type(exc).__name__}: {first}"
        with_traceback = not isinstance(exc, TrainingFailure)
        try:
            report = f"the whole report: {_write_failure(run_dir_for(plan), exc, with_traceback=with_traceback)}"
        except OSError as unwritable:  # the run folder itself is the trouble: the report goes to the terminal
            text = "".join(traceback.format_exception(exc)) if with_traceback else f"{exc}\n"
            report = f"the run folder could not hold failure.log ({unwritable}); the whole report:\n{text}"
        print(f"hybridrl train: {cause}\n  {report}", file=sys.stderr)
        return 1
    print(result.summary)
    return 0


def _needs_a_cluster(config: JobConfig, address: str | None) -> str | None:
    """Why a job of several machines cannot run without a Ray cluster to join (None when it can): with no address
    (or `local`) train starts a private Ray cluster of this machine alone, which no other machine can join, and its
    pools would wait for machines that never come (`trainer.nnodes=2` on a login node without RAY_ADDRESS)."""
    rollout, teacher = config.actor_rollout_ref.rollout, config.teacher
    pools = [("trainer.nnodes", config.trainer.nnodes)]
    if rollout.mode == "disaggregated":
        pools.append(("actor_rollout_ref.rollout.nnodes", rollout.nnodes))
    if config.algorithm.distillation.enable and teacher.mode == "disaggregated":
        pools.append(("teacher.nnodes", teacher.nnodes))
    field, machines = max(pools, key=lambda pool: pool[1])
    if machines <= 1:
        return None
    started = "trainer.ray_address=local starts" if address == "local" else \
        "neither trainer.ray_address nor RAY_ADDRESS names one, so this run would start"
    return (f"{field}={machines} needs a Ray cluster of {machines} machines, but {started} a Ray cluster of this "
            "machine alone, which no other machine can join: start Ray on every machine (launch/ray_head.sh on "
            "the first, launch/ray_worker.sh on the others; launch/slurm_grpo.sbatch under Slurm) and set "
            f"RAY_ADDRESS (or trainer.ray_address) to the head's address, or run on this machine with {field}=1")


# A disk that will not take the run's files: full, over quota, read-only, or not this user's to write. The machine's
# state, not hybridrl's bug: said in a line, with no traceback.
DISK_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def _disk_refused(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_REFUSALS


class Stopped(KeyboardInterrupt):
    """A stop signal other than Ctrl-C arrived: raised in the main thread wherever it was, so that the run ends as
    Ctrl-C ends it (a save in progress discarded, the metrics file closed, the workers and Ray shut down, one line
    and exit code 128 + the signal) rather than by the signal's default action (killed on the spot, Ray's processes
    left to die on their own, and no word) or by Ray's SIGTERM handlers (a native stack dump, then an abort)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# SLURM's scancel and time limit, Kubernetes' pod deletion, `kill`: SIGTERM (SIGKILL follows a grace period later);
# a closed terminal or ssh session: SIGHUP
STOPPED_BY = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_signals_interrupt(received: list[int]) -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Stopped` while the body runs, and are appended to `received` (the first one only:
    later ones, say a scheduler's repeat during the few seconds of the clean-up, are ignored rather than cut it
    short). A signal this process was told to ignore (`nohup` ignores SIGHUP) stays ignored. The handlers found are
    put back after."""

    def stop(signum: int, frame: object) -> None:
        if not received:
            received.append(signum)
            raise Stopped(signum)

    previous = {signum: signal.getsignal(signum) for signum in STOPPED_BY}
    for signum, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _write_failure(run_dir: Path, error: BaseException, *, with_traceback: bool) -> Path:
    """The failure's full text (and traceback) in `<run dir>/failure.log`, for the one-line message to point at."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "failure.log"
    text = "".join(traceback.format_exception(error)) if with_traceback else f"{error}\n"
    with atomic_file(log) as partial:
        partial.write_text(text)
    return log
