"""`hybridrl train CONFIG [overrides]`: plan (refusing a bad config before anything starts), then train."""
from __future__ import annotations

import argparse
import sys

from hybridrl.config.errors import ConfigError
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import packing_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines)")
    parser.add_argument("--skip-version-check", action="store_true",
                        help="start even on a stack `hybridrl doctor` refuses (at your own risk)")


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_sources(args.config, list(args.overrides))
    except ConfigError as exc:
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    # a default that depends on the device: say what it resolved to
    print(packing_line(plan), file=sys.stderr)

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
    from hybridrl.trainer.trainer import Trainer, TrainingFailure

    try:
        result = Trainer(plan, progress=not args.no_progress).fit()
    except TrainingFailure as exc:  # step, phase, role, rank and cause; workers already torn down
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # what only loading the user's files shows (a tools file's parsers), before Ray
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 2
    print(result.summary)
    return 0
