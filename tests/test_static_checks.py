"""The static checks run with the tests, so CI holds them: ruff over every Python file of the repository, and mypy over
`hybridrl` (configured in pyproject.toml) against a baseline of errors per file (`tests/mypy_baseline.json`) that may
only go down: a change that adds a type error, or a new file with one, fails here; a change that removes some fails
too until the baseline says so (run this file with `HYBRIDRL_WRITE_MYPY_BASELINE=1` to rewrite it), so the baseline
stays the truth. The packages at the worker seam (`TYPED_PACKAGES`) must have no type error at all, whatever the
baseline says."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "mypy_baseline.json"
ERROR = re.compile(r"^(hybridrl/[^:]+):\d+: error:", re.MULTILINE)
# where the trainer, the controller and the workers meet the models, the rollout and the resharder: fully typed
TYPED_PACKAGES = ("controller", "reshard", "trainer", "training", "workers")


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", name, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@functools.cache
def _mypy() -> subprocess.CompletedProcess[str]:
    result = _tool("mypy", "--no-incremental", "hybridrl")
    assert "error: " not in result.stderr, result.stderr[-2000:]  # mypy itself failing (a config error, a crash)
    return result


def in_typed_packages(errors: dict[str, int]) -> dict[str, int]:
    return {path: count for path, count in errors.items() if path.split("/")[1] in TYPED_PACKAGES}


def mypy_errors_per_file(output: str) -> dict[str, int]:
    return dict(sorted(Counter(match.group(1) for match in ERROR.finditer(output)).items()))


def ratchet(now: dict[str, int], baseline: dict[str, int]) -> tuple[list[str], list[str]]:
    """(the files with more errors than the baseline allows, the files with fewer)."""
    worse = [f"{path}: {count} error(s), the baseline allows {baseline.get(path, 0)}"
             for path, count in now.items() if count > baseline.get(path, 0)]
    better = [f"{path}: {now.get(path, 0)} error(s), the baseline says {count}"
              for path, count in baseline.items() if now.get(path, 0) < count]
    return worse, better


def test_ruff_finds_nothing():
    result = _tool("ruff", "check", "hybridrl", "tests", "bench", "tools")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_worker_seam_packages_have_no_type_error():
    result = _mypy()
    typed = in_typed_packages(mypy_errors_per_file(result.stdout))
    assert not typed, "type errors in " + ", ".join(TYPED_PACKAGES) + ":\n" + "\n".join(
        line for line in result.stdout.splitlines() if line.split(":")[0] in typed)[-6000:]


def test_mypy_errors_stay_within_the_baseline():
    result = _mypy()
    now = mypy_errors_per_file(result.stdout)
    if os.environ.get("HYBRIDRL_WRITE_MYPY_BASELINE"):
        BASELINE.write_text(json.dumps(now, indent=1) + "\n")
    worse, better = ratchet(now, json.loads(BASELINE.read_text()))
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not worse, "type errors above the baseline:\n" + "\n".join(worse) + "\n\n" + "\n".join(
        line for line in errors if any(line.startswith(w.split(":")[0] + ":") for w in worse))[-6000:]
    assert not better, ("fewer type errors than tests/mypy_baseline.json says: lower it "
                        "(HYBRIDRL_WRITE_MYPY_BASELINE=1 python -m pytest tests/test_static_checks.py):\n"
                        + "\n".join(better))


def test_the_ratchet_refuses_a_new_error_and_a_stale_baseline():
    baseline = {"hybridrl/a.py": 2}
    assert ratchet({"hybridrl/a.py": 2}, baseline) == ([], [])
    assert ratchet({"hybridrl/a.py": 3}, baseline)[0] == ["hybridrl/a.py: 3 error(s), the baseline allows 2"]
    assert ratchet({"hybridrl/a.py": 2, "hybridrl/b.py": 1}, baseline)[0] == [
        "hybridrl/b.py: 1 error(s), the baseline allows 0"]
    assert ratchet({}, baseline)[1] == ["hybridrl/a.py: 0 error(s), the baseline says 2"]
    output = "hybridrl/a.py:3: error: Incompatible types  [assignment]\nhybridrl/a.py:9: error: x\nFound 2 errors"
    assert mypy_errors_per_file(output) == {"hybridrl/a.py": 2}
    assert in_typed_packages({"hybridrl/workers/x.py": 1, "hybridrl/config/y.py": 2, "hybridrl/cli.py": 1}) == {
        "hybridrl/workers/x.py": 1}
