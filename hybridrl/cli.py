"""The `hybridrl` command: one entry point, one subcommand per job.

Each subcommand's module is imported only when that subcommand runs, so `hybridrl plan` stays
fast (no torch, no Ray) and a broken optional stack cannot break unrelated subcommands.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hybridrl.config.plan_cli", "validate a config and print every derived number"),
    "train": ("hybridrl.trainer.train_cli", "train a PPO/GRPO job (plans first; refuses a bad config)"),
    "convert": ("hybridrl.models.convert_cli", "convert checkpoints between HF and Megatron layouts"),
    "doctor": ("hybridrl.parallel.doctor_cli", "report the installed stack and refuse incompatible versions"),
    "hardware": ("hybridrl.config.hardware_cli", "list the GPU descriptions step times are predicted with, or "
                                                  "measure this machine's"),
}


def _version() -> str:
    """The installed distribution's version (what pip reports), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridrl")
    except PackageNotFoundError:
        return "(source tree, not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybridrl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(sub_parser)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            sub_parser.set_defaults(_missing=f"subcommand '{name}' is not available in this build")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `plan job.yaml --format json a.b=1`: overrides after a flag (argparse stops the positional list there)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(a.startswith("-") for a in extra):
        args.overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "_missing", None):
        print(f"hybridrl: {args._missing}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
