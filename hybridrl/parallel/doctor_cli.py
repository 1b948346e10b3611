"""`hybridrl doctor [--device auto|cuda|cpu] [--imports]`: print the software stack and whether a job can run on it.

Exit 0 when the stack passes `hybridrl.parallel.versions.check_stack`, 1 with every refusal listed
otherwise. Versions come from package metadata, which can say a package is there while its import
fails (a torch extension built against another torch, a missing shared library): `--imports` also
imports each package of the job's stack for real and refuses on any failure. The Docker image runs
`--imports` at the end of its build and the metadata check as its health check. torch is imported
only inside `run`.
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.parallel.device import resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="the job's device (auto: cuda when torch sees a GPU)")
    parser.add_argument("--imports", action="store_true",
                        help="also import every package of the stack (torch, megatron.core, vllm, ray, "
                             "transformers, TransformerEngine on cuda when installed, hybridrl)")


def run(args: argparse.Namespace) -> int:
    # lazy: versions loads importlib.metadata and packaging (~70 ms), and every `hybridrl` command
    # (`--help` included) imports this module to build its parser.
    from hybridrl.parallel.versions import IMPORTS, PACKAGES, check_stack, collect_versions, import_problems

    versions = collect_versions()
    if args.device == "auto" and versions.get("torch"):
        device = resolve_device("auto")
    else:
        device = "cpu" if args.device == "auto" else args.device
    for name in ("python", *PACKAGES, "torch_cuda", "nccl"):
        print(f"{name:20s} {versions.get(name) or '-'}")
    check = check_stack(versions, device)
    problems = list(check.problems)
    if args.imports:
        # TE is optional on GPUs (a warning above when absent): imported only when installed
        modules = [m for m in IMPORTS[device]
                   if not (m.startswith("transformer_engine") and not versions.get("transformer-engine"))]
        failed = import_problems(modules)
        problems.extend(failed)
        if not failed:
            print(f"imports: {', '.join(modules)} ok")
    for warning in check.warnings:
        print(f"warning: {warning}")
    if problems:
        for problem in problems:
            print(f"refused: {problem}", file=sys.stderr)
        print(f"hybridrl doctor: the stack cannot run a {device} job", file=sys.stderr)
        return 1
    print(f"ok: the stack can run a {device} job")
    return 0
