"""Inter-node traffic per phase, measured on a real network link against the plan's model of it.

Two hosts as network namespaces on a bridge (`tests/support/netns_hosts.Cluster`, root only), a Ray node on each from
`launch/ray_head.sh` / `launch/ray_worker.sh`, and `hybridrl train` of the CPU demo for 3 steps on three layouts:
data parallelism across the hosts (DP2: the gradient all-reduce crosses), a pipeline across them (PP2: the
activations, their gradients and the weight sync's other stage cross) and a disaggregated rollout pool on the
second host (every weight sync crosses whole). Each host's link counter is read every
5 ms; each phase's bytes are the counter at its end less at its start (the run's timeline.jsonl). The planned
figure is `hybridrl.config.internode.plan_internode_traffic` given the tokens the actor computed. Prints the
table (median over the steps, per host) and writes bench/results/internode_traffic.json.

    sudo python bench/internode_traffic.py
"""
from __future__ import annotations

import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.cluster_runs import (  # noqa: E402
    DISAGGREGATED,
    assert_traffic_is_planned,
    pool_hosts,
    start_ray,
    train,
)
from tests.support.netns_hosts import Cluster  # noqa: E402
from tools.demo_assets import build_demo_assets, demo_overrides  # noqa: E402

# name -> (overrides, CPUs per host): at one CPU a host holds one pool (each rank takes half a CPU)
LAYOUTS = {"DP2 across the hosts": (["trainer.nnodes=2", "trainer.n_gpus_per_node=1"], 4),
           "PP2 across the hosts": (["trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], 4),
           "disaggregated: rollout pool on host 1": (DISAGGREGATED, 1)}
PHASES = ("gen", "reward", "adv", "update_actor", "sync")


def measure(work: Path, assets: Path, name: str, extra: list[str], cpus: int) -> dict:
    run = work / name.split()[0].strip(":")
    overrides = [*demo_overrides(assets, run), "trainer.total_training_steps=3", *extra]
    ray_temp = tempfile.mkdtemp(prefix="hrl-ray-")
    try:
        with Cluster(2) as cluster:
            address = start_ray(cluster, work, ray_temp, cpus=cpus)
            with cluster.link_samples() as samples:
                result = train(cluster, cluster.hosts[0], address, work, *overrides)
            addresses = [h.address for h in cluster.hosts]
        if result.returncode != 0:
            raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
        if extra is DISAGGREGATED:  # the plan's node 0 is the trainer pool's host, node 1 the rollout pool's
            return assert_traffic_is_planned(samples, run, overrides, hosts=pool_hosts(result.stdout),
                                             addresses=addresses)
        return assert_traffic_is_planned(samples, run, overrides)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def median_table(figures: dict) -> dict[str, dict[str, list[float]]]:
    """phase -> {"measured": [host 0, host 1], "planned": [...]}: the median over the steps."""
    out = {}
    for phase in PHASES:
        rows = figures["steps"]
        out[phase] = {kind: [statistics.median(step[kind].get(phase, [0, 0])[host] for step in rows)
                             for host in range(2)] for kind in ("measured", "planned")}
    return out


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="hrl-traffic-"))
    assets = build_demo_assets(work / "demo")
    results = {"machine": f"{platform.machine()}, two network namespaces on a Linux bridge (veth)",
               "model": "configs/models/tiny-demo (Llama, 0.62 M parameters, fp32)", "steps": 3, "layouts": {}}
    for name, (extra, cpus) in LAYOUTS.items():
        figures = measure(work, assets, name, extra, cpus)
        results["layouts"][name] = {"table": median_table(figures), "per_step": figures["steps"]}
        print(f"\n{name} (median of 3 steps; bytes each host sent; host 0 holds the controller)")
        print(f"{'phase':>14} {'measured h0':>13} {'measured h1':>13} {'planned h0':>12} {'planned h1':>12}")
        for phase, row in results["layouts"][name]["table"].items():
            print(f"{phase:>14} " + " ".join(f"{v:>13,.0f}" for v in row["measured"])
                  + " " + " ".join(f"{v:>12,.0f}" for v in row["planned"]))
    out = ROOT / "bench/results/internode_traffic.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
