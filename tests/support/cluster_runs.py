"""`hybridrl train` across hosts made of network namespaces (`netns_hosts.Cluster`): a Ray node on each host
started by the project's launch scripts, a run from the head's host, and its traffic per phase against the plan's.
Shared by the multi-host tests and `bench/internode_traffic.py`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.netns_hosts import Cluster, Host, LinkSamples

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = "configs/examples/cpu_tiny_grpo.yaml"


def env_of(tmp: Path) -> dict[str, str]:
    """A host's environment: a HOME of its own, but vLLM's cache the test session's (hosts that have run vLLM
    before): without it each vLLM rank learns its model's class in a fresh interpreter that imports vLLM (its
    registry's `inspect_model_cls` subprocess, ~15 CPU-s here), which a machine does once per model and vLLM."""
    return {"PATH": f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin", "NUM_GPUS": "0", "HOME": str(tmp / "home"),
            "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "VLLM_CACHE_ROOT": vllm_cache_root()}


def vllm_cache_root() -> str:
    """The folder vLLM caches in for this process's environment (`vllm.envs.VLLM_CACHE_ROOT`'s rule)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm")
    return os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", default))


def start_ray(cluster: Cluster, tmp: Path, temp: str, launch: Path = ROOT / "launch",
              join_timeout_s: float = 180, cpus: int = 4) -> str:
    """A Ray node on every host with launch/ray_head.sh and launch/ray_worker.sh, `cpus` CPUs each; the head's
    address once every node has joined."""
    head, *others = cluster.hosts
    env = env_of(tmp)
    started = cluster.run(head, ["bash", str(launch / "ray_head.sh"), f"--num-cpus={cpus}", f"--temp-dir={temp}"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    address = re.search(r"RAY_ADDRESS=(\S+)", started.stdout).group(1)
    for host in others:
        joined = cluster.run(host, ["bash", str(launch / "ray_worker.sh"), address, f"--num-cpus={cpus}"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=join_timeout_s)
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
    wait = ("import ray, sys, time\nray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "for _ in range(60):\n    alive = [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]\n"
            "    if len(alive) == int(sys.argv[2]):\n        break\n    time.sleep(1)\nprint(sorted(alive))")
    nodes = cluster.run(head, [sys.executable, "-c", wait, address, str(len(cluster.hosts))], env=env,
                        capture_output=True, text=True, timeout=120)
    assert nodes.stdout.strip() == str(sorted(h.address for h in cluster.hosts)), nodes.stdout + nodes.stderr
    return address


def train(cluster: Cluster, host: Host, address: str, tmp: Path, *overrides: str,
          timeout: int = 900) -> subprocess.CompletedProcess:
    return cluster.run(host, [str(BIN / "hybridrl"), "train", CONFIG, *overrides],
                       env={**env_of(tmp), "RAY_ADDRESS": address}, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)


# Traffic per phase against the plan's model of it (`hybridrl.config.internode`): the bytes a host sent in a phase
# (its link's counter read at the phase's start and end, from the run's timeline.jsonl) and the plan's figure for
# that phase, given the tokens the run computed. Per host, for the phases the model counts: measured within
# [planned, 1.10 x planned + CONTROL_BYTES]. Above the model: TCP/IP headers (~2.5 % here) and Ray's calls: the
# controller on the head host sends the step's rows to the other host's worker (up to ~100 KB a phase here).
# Phases the model counts nothing for (gen, reward, adv) stay under CONTROL_BYTES.
CONTROL_BYTES = 150_000


def phase_traffic(samples: LinkSamples, run: Path) -> list[dict[str, list[int]]]:
    """Per step: phase -> the bytes each host sent during it."""
    out = []
    for row in (json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()):
        phases = sorted({key.rsplit("/", 1)[0] for key in row if key.endswith("/start")} - {"step"})
        out.append({phase: [samples.sent(host, row[f"{phase}/start"], row[f"{phase}/end"])
                            for host in range(samples.hosts)] for phase in phases})
    return out


def assert_traffic_is_planned(samples: LinkSamples, run: Path, overrides: list[str],
                              hosts: tuple[str, ...] | None = None,
                              addresses: list[str] | None = None) -> dict[str, Any]:
    """Every step's measured bytes per phase and host against the plan's (see CONTROL_BYTES); the figures.
    `hosts`: the address of the plan's node 0, 1, ... where it is not the cluster's host order (`addresses`)."""
    from hybridrl.config.internode import plan_internode_traffic
    from hybridrl.config.plan import plan_from_sources

    plan = plan_from_sources(CONFIG, overrides)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    figures = []
    for measured, metrics in zip(phase_traffic(samples, run), steps, strict=True):
        # the tokens the actor computed: the rows' real tokens less the prompts computed once per micro-batch
        computed = metrics["perf/total_num_tokens"] * (1 - metrics["perf/shared_prefix_ratio"])
        planned = plan_internode_traffic(plan, {"actor": computed / (1 - metrics["perf/padding_ratio"])}).phases
        if hosts is not None:  # the plan's nodes in the cluster's host order
            planned = {phase: tuple(sent[hosts.index(address)] for address in addresses)
                       for phase, sent in planned.items()}
        for phase, sent in measured.items():
            plan_bytes = planned.get(phase, (0,) * len(sent))
            for host, (got, want) in enumerate(zip(sent, plan_bytes)):
                assert want <= got <= 1.10 * want + CONTROL_BYTES, (phase, host, sent, plan_bytes)
        figures.append({"measured": measured, "planned": {k: list(v) for k, v in planned.items()}})
    return {"steps": figures}


DISAGGREGATED = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.mode=disaggregated",
                 "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]


def pool_hosts(stdout: str) -> tuple[str, str]:
    """(the trainer pool's host, the rollout pool's host) from train's placement lines (DISAGGREGATED's pools)."""
    trainer = re.search(r"actor_rollout_ref \(pool trainer\): 2 rank\(s\) on 1 node\(s\): (\S+) ranks 0-1", stdout)
    rollout = re.search(r"rollout \(pool rollout\): 1 rank\(s\) on 1 node\(s\): (\S+) rank 0", stdout)
    assert trainer and rollout, stdout[-3000:]
    return trainer.group(1), rollout.group(1)
