"""`hybridrl train CONFIG [overrides]`: plan (refusing a bad config before anything starts), then train."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=10")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (plain log lines)")


def run(args: argparse.Namespace) -> int:
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.plan import plan_from_sources

    try:
        plan = plan_from_sources(args.config, list(args.overrides))
    except ConfigError as exc:
        print(f"hybridrl train: {exc}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)

    from hybridrl.trainer.trainer import Trainer

    result = Trainer(plan, progress=not args.no_progress).fit()
    print(result.summary)
    return 0
