#!/usr/bin/env python
"""What the python tool's operating-system sandbox costs: start-up per call, and a rollout's tool round.

Per call (median of `--calls` runs of `print(1)`): a bare ``python -I`` subprocess, the hook-only
subprocess (``isolation: none``), and the namespace sandbox (bubblewrap + seccomp + limits). Then a
rollout's worth of calls the way the agent loop makes them: 64 samples x 4 calls, each a short
program, on the loop's 8 tool threads (`AgentLoopSettings.tool_workers`), through
`build_registry(["python"])`, in both isolations: the wall time of the whole round is what a step
waits on the tools.

    python bench/sandbox.py            # prints the figures; writes bench/results/sandbox.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrl.rollout.agent_loop import AgentLoopSettings  # noqa: E402
from hybridrl.tool_calling import SandboxLimits, ToolStatus, build_registry, run_python  # noqa: E402
from hybridrl.tool_calling.parsing import ToolCall  # noqa: E402

RESULT = ROOT / "bench" / "results" / "sandbox.json"
PROGRAM = "import math\nprint(sum(math.isqrt(i) for i in range(20000)))"


def _median_seconds(run, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bare() -> None:
    subprocess.run([sys.executable, "-I", "-c", "print(1)"], capture_output=True, check=True)


def _round(isolation: str, samples: int, calls_per_sample: int, workers: int) -> tuple[float, int]:
    registry = build_registry(["python"], sandbox=SandboxLimits(wall_time_s=60), isolation=isolation)
    calls = [ToolCall("python", {"code": PROGRAM}, i) for i in range(samples * calls_per_sample)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        observations = list(pool.map(registry.execute, calls))
    ok = sum(o.status is ToolStatus.OK for o in observations)
    return time.perf_counter() - start, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--calls-per-sample", type=int, default=4)
    args = parser.parse_args()
    workers = AgentLoopSettings().tool_workers
    per_call = {
        "bare_python_s": _median_seconds(_bare, args.calls),
        "hook_only_s": _median_seconds(lambda: run_python("print(1)", isolation="none"), args.calls),
        "namespaces_s": _median_seconds(lambda: run_python("print(1)"), args.calls),
    }
    per_call["namespaces_overhead_s"] = per_call["namespaces_s"] - per_call["hook_only_s"]
    rounds = {}
    for isolation in ("none", "namespaces"):
        seconds, ok = _round(isolation, args.samples, args.calls_per_sample, workers)
        rounds[isolation] = {"wall_s": seconds, "ok": ok, "calls": args.samples * args.calls_per_sample,
                             "calls_per_s": args.samples * args.calls_per_sample / seconds}
    result = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
              "per_call_median": per_call, "rollout_round": rounds, "tool_workers": workers,
              "samples": args.samples, "calls_per_sample": args.calls_per_sample, "program": PROGRAM}
    print(f"start-up per call (median of {args.calls}): bare python {per_call['bare_python_s'] * 1e3:.0f} ms, "
          f"hook-only {per_call['hook_only_s'] * 1e3:.0f} ms, namespaces {per_call['namespaces_s'] * 1e3:.0f} ms "
          f"(+{per_call['namespaces_overhead_s'] * 1e3:.0f} ms)")
    for isolation, figures in rounds.items():
        print(f"{args.samples} samples x {args.calls_per_sample} calls on {workers} threads, isolation={isolation}: "
              f"{figures['wall_s']:.2f} s ({figures['calls_per_s']:.0f} calls/s, "
              f"{figures['ok']}/{figures['calls']} ok)")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
