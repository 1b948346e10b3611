"""`hybridrl plan CONFIG [overrides]`: validate a job config and print every derived number.

Exit 0 with the report when the config is valid; exit 2 with every error on stderr when not.
Needs no GPU, no Ray, no torch.
"""
from __future__ import annotations

import argparse
import json
import sys

from hybridrl.config.errors import ConfigError
from hybridrl.config.loader import config_and_overrides
from hybridrl.config.plan import plan_from_sources
from hybridrl.config.report import render_plan, render_search, render_sizing, search_json, sizing_json
from hybridrl.config.search import search_from_sources, search_inputs, size_cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML job config (defaults only when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.rollout.n=12")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="report format")
    parser.add_argument("--search", action="store_true",
                        help="try every layout of the job's cluster (TP, PP, vLLM's TP, colocated or a rollout pool "
                             "of its own, offload, recompute) and print the fastest by the predicted step time "
                             "(needs trainer.hardware)")
    parser.add_argument("--top", type=int, default=None, help="--search: how many layouts to print (default 5)")
    parser.add_argument("--target-step-time", type=float, default=None, metavar="SECONDS",
                        help="--search: the smallest cluster (the job's GPU type; part of a machine, then 1, 2, 4, "
                             "... machines) whose best layout predicts a step of at most SECONDS")
    parser.add_argument("--layout-only", action="store_true",
                        help="size the layout from the model's config.json alone: skip the checks of the model's "
                             "weights and tokenizer, the data files and the reward code that `train` needs")


def run(args: argparse.Namespace) -> int:
    config_path, overrides = config_and_overrides(args.config, args.overrides)
    if args.top is not None and (not args.search or args.top < 1):
        print(f"hybridrl plan: --top={args.top} needs --search and a number of layouts >= 1", file=sys.stderr)
        return 2
    top = args.top if args.top is not None else 5
    if args.target_step_time is not None and (not args.search or not args.target_step_time > 0):
        print(f"hybridrl plan: --target-step-time={args.target_step_time} needs --search and a number of seconds > 0",
              file=sys.stderr)
        return 2
    try:
        if args.target_step_time is not None:
            sizing = size_cluster(search_inputs(config_path, overrides), args.target_step_time)
        elif args.search:
            result = search_from_sources(config_path, overrides)
        else:
            plan = plan_from_sources(config_path, overrides, check_files=not args.layout_only)
    except ConfigError as exc:
        if args.format == "json":
            print(json.dumps(exc.to_dict(), indent=2, default=str), file=sys.stderr)
        else:
            print(f"hybridrl plan: {exc}", file=sys.stderr)
        return 2
    # A search that finds no layout (or no cluster size meeting the target) answers, and exits 1: a script can tell
    # "nothing fits" from an answer, as it tells a refused job (2)
    if args.target_step_time is not None:
        print(json.dumps(sizing_json(sizing, config_path, overrides), indent=2) if args.format == "json"
              else render_sizing(sizing, config_path, overrides))
        return 0 if sizing.smallest is not None else 1
    if args.search:
        print(json.dumps(search_json(result, config_path, overrides), indent=2) if args.format == "json"
              else render_search(result, config_path, overrides, top))
        return 0 if result.ranked else 1
    print(plan.to_json() if args.format == "json" else render_plan(plan))
    return 0
