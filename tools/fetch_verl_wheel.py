#!/usr/bin/env python
"""Fetch verl's own wheel, whose generated trainer YAMLs the whole-file tests plan (tests/config/test_verl_file.py).

    python tools/fetch_verl_wheel.py                  # data/verl/verl-0.9.1-py3-none-any.whl (make verl-wheel)

Idempotent: a wheel already there with the expected sha256 is kept (nothing downloaded). Otherwise
`pip download verl==0.9.1 --no-deps` fetches it from PyPI (none of verl's dependencies: the tests only read YAML
files out of the zip) and its sha256 is checked. The repository keeps no copy of verl's files.
"""
from __future__ import annotations

import argparse
import fcntl
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/...` resolves hybridrl and tools to this checkout
    sys.path.insert(0, str(REPO))

from tools.pypi_wheel import FetchError, fetch_wheel  # noqa: E402 (after the path fix above)

VERL_VERSION = "0.9.1"
WHEEL_NAME = f"verl-{VERL_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"
DEFAULT_DIR = REPO / "data" / "verl"
# verl's fully composed default configs, one per training backend (verl/trainer/config/_generated_*.yaml)
MEGATRON_YAML = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"
FSDP_YAML = "verl/trainer/config/_generated_ppo_trainer.yaml"


def ensure_verl_wheel(folder: str | Path = DEFAULT_DIR, quiet: bool = False) -> Path:
    """The checked wheel in `folder`, downloaded when absent (one downloader at a time: xdist workers may race)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return fetch_wheel(folder, f"verl=={VERL_VERSION}", WHEEL_NAME, WHEEL_SHA256, quiet)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_member(wheel: Path, member: str) -> str:
    """One text file of the wheel (a generated trainer YAML)."""
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member).decode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help="where the wheel is kept")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        wheel = ensure_verl_wheel(args.dir, quiet=args.quiet)
    except FetchError as exc:
        print(f"fetch_verl_wheel: error: {exc}", file=sys.stderr)
        return 1
    print(f"{wheel}: verl {VERL_VERSION}, sha256 checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
