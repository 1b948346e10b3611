"""A tools file whose tool runs model-written code in hybridrl's operating-system sandbox.

`run_tests` takes a solution the model wrote and runs the problem's tests against it, both as files in
the sandbox's private folder, with the job's kernel limits: the tools file itself is trusted code (it
runs in the rollout worker), but the model's solution only ever runs inside `run_sandboxed`. Offer it
with `multi_turn.tools: [run_tests]` and `multi_turn.tools_file: configs/examples/sandboxed_tools.py`;
each data row carries its tests in `extra_info.tests` (Python asserts on `solution`).
"""
from __future__ import annotations

import sys

from hybridrl.tool_calling import SandboxLimits, ToolResult, ToolStatus, run_sandboxed

TOOL_SCHEMAS = [{
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the problem's tests against your Python solution and see which fail.",
        "parameters": {"type": "object",
                       "properties": {"solution": {"type": "string", "description": "a Python module"}},
                       "required": ["solution"]},
    },
}]

LIMITS = SandboxLimits(wall_time_s=10, cpu_time_s=5, memory_mb=512, max_output_bytes=4096)


def run_tests(solution: str, sample) -> ToolResult:  # `sample`: the calling row (not in the schema)
    tests = (sample.get("extra_info") or {}).get("tests", "")
    run = run_sandboxed([sys.executable, "test_solution.py"], limits=LIMITS,
                        files={"solution.py": solution.encode(), "test_solution.py": f"import solution\n{tests}\n"
                               "print('all tests passed')\n".encode()})
    if run.status is ToolStatus.OK:
        return ToolResult(run.stdout)
    return ToolResult(f"{run.stdout}{run.stderr}\n[{run.reason}]", run.status)
