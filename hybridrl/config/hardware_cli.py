"""`hybridrl hardware [--measure [--ranks N] [--out FILE]]`: the hardware descriptions the plan predicts step times
with (`trainer.hardware`).

Without `--measure`: the shipped GPUs' figures. With it: this machine measured as one rank of a CPU job whose `N`
ranks share its cores (`parallel.measure`), printed, and with `--out` written as a YAML file that
`trainer.hardware=FILE` reads. torch is imported only for `--measure`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridrl.config.hardware import NUMBER_FIELDS, SHIPPED, Efficiency, Hardware, HardwareError, load_hardware
from hybridrl.config.report import table
from hybridrl.persistence import creation_problem, write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measure", action="store_true",
                        help="measure this machine as one rank of a CPU job (matmul per dtype, memory, the gloo "
                             "link between two local processes)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="--measure: the ranks sharing this machine's cores (a CPU job's trainer.n_gpus_per_node)")
    parser.add_argument("--repeats", type=int, default=5, help="--measure: timings per figure (the best counts)")
    parser.add_argument("--out", default=None, help="--measure: write the description here (YAML)")


def run(args: argparse.Namespace) -> int:
    if not args.measure:
        if args.out is not None:
            print("hybridrl hardware: --out writes a measured description: add --measure", file=sys.stderr)
            return 2
        print(table(["name", *NUMBER_FIELDS], [[hw.name, *(getattr(hw, f) for f in NUMBER_FIELDS)]
                                               for hw in SHIPPED.values()]))
        return 0
    bad = [f"--{name}={value} (an integer >= 1)" for name, value in (("ranks", args.ranks), ("repeats", args.repeats))
           if value < 1]
    if args.out is not None and Path(args.out).suffix not in (".yaml", ".yml"):
        bad.append(f"--out={args.out} (a .yaml file: trainer.hardware reads YAML)")
    elif args.out is not None:  # checked before measuring (a minute), not found unwritable after it
        if Path(args.out).is_dir():
            bad.append(f"--out={args.out} is a folder (name the .yaml file to write)")
        elif problem := creation_problem(Path(args.out).parent):
            bad.append(f"--out={args.out} cannot be written: {problem} (name a .yaml file in a folder you can write)")
    if bad:
        print(f"hybridrl hardware: {'; '.join(bad)}", file=sys.stderr)
        return 2
    hardware, text = measured_description(args.ranks, args.repeats)
    print(text, end="")
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, text)
        try:  # what was written is what the plan will read
            load_hardware(args.out)
        except HardwareError as exc:  # pragma: no cover - the text above is built from the same fields
            print(f"hybridrl hardware: {args.out}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}: use it with trainer.hardware={args.out}")
    return 0


# What a measured description reaches of its own figures where the work is what measured them: the link (an
# exchange, as the weight sync's) and a streaming read (the memory figure is a copy's). The other efficiencies keep
# the stated values until fitted (bench/time_vs_plan.py does for this machine).
MEASURED_EFFICIENCY = Efficiency(link=1.0, stream_memory=1.0)


def measured_description(ranks: int, repeats: int) -> tuple[Hardware, str]:
    """This machine's figures for one of `ranks` ranks, as a `Hardware` and as the YAML text of it."""
    from hybridrl.parallel.measure import machine_name, measure_rank

    figures = measure_rank(ranks, repeats)
    hardware = Hardware(
        name=f"{machine_name()}, 1 of {ranks} rank(s)",
        bf16_tflops=_figure(figures.bf16_tflops), fp32_tflops=_figure(figures.fp32_tflops),
        memory_gb_per_s=_figure(figures.memory_gb_per_s),
        # one machine: its ranks meet over loopback, and network namespaces joined by veth links (the test suite's
        # hosts) go through the same kernel copy, so the exchange's figure stands for both
        intra_node_gb_per_s=_figure(figures.link_gb_per_s), inter_node_gb_per_s=_figure(figures.link_gb_per_s),
        # offloading on a CPU is a copy within the host's memory
        host_gb_per_s=_figure(figures.memory_gb_per_s), link_latency_us=_figure(figures.link_latency_us),
        efficiency=MEASURED_EFFICIENCY)
    lines = [f"# measured by `hybridrl hardware --measure --ranks {ranks}`: one rank's figures with "
             f"{figures.threads} thread(s), the best of {repeats} timings each (the link: 64 MiB sent each way at "
             f"once; link_latency_us: the median of {50 * repeats} all-reduces of 8 floats)",
             f"name: {hardware.name!r}"]
    lines += [f"{name}: {getattr(hardware, name)}" for name in (*NUMBER_FIELDS, "link_latency_us")]
    lines += ["efficiency:", "  # the link and a streaming read at the rates measured above (not datasheet peaks)",
              f"  link: {MEASURED_EFFICIENCY.link}", f"  stream_memory: {MEASURED_EFFICIENCY.stream_memory}"]
    return hardware, "\n".join(lines) + "\n"


def _figure(value: float) -> float:
    """Four significant digits (a CPU's bf16 matmul can be a thousandth of a TFLOP/s)."""
    return float(f"{value:.4g}")
