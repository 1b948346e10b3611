"""`hybridrl doctor [--device auto|cuda|cpu]`: print the software stack and whether a job can run on it.

Exit 0 when the stack passes `hybridrl.parallel.versions.check_stack`, 1 with every refusal listed
otherwise. The Docker image uses it as its health check. torch is imported only inside `run`.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="the job's device (auto: cuda when torch sees a GPU)")


def run(args: argparse.Namespace) -> int:
    from hybridrl.parallel.versions import PACKAGES, check_stack, collect_versions

    versions = collect_versions()
    if args.device == "auto" and versions.get("torch"):
        from hybridrl.parallel.device import resolve_device

        device = resolve_device("auto")
    else:
        device = "cpu" if args.device == "auto" else args.device
    for name in ("python", *PACKAGES, "torch_cuda", "nccl"):
        print(f"{name:20s} {versions.get(name) or '-'}")
    check = check_stack(versions, device)
    for warning in check.warnings:
        print(f"warning: {warning}")
    if not check.ok:
        for problem in check.problems:
            print(f"refused: {problem}", file=sys.stderr)
        print(f"hybridrl doctor: the stack cannot run a {device} job", file=sys.stderr)
        return 1
    print(f"ok: the stack can run a {device} job")
    return 0
