"""The cluster launch scripts: shellcheck-clean, and they refuse bad input before touching Ray."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.netns_hosts import BRIDGE_IP, CLUSTER_IP, multi_homed_host

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + sorted((ROOT / "launch").glob("*.sbatch"))


def test_scripts_exist_and_are_executable():
    names = {p.name for p in SCRIPTS}
    assert {"train_grpo.sh", "train_ppo.sh", "ray_head.sh", "ray_worker.sh", "slurm_grpo.sbatch"} <= names
    assert all(p.stat().st_mode & 0o111 for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck") or str(Path(__import__("sys").executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_train_script_refuses_a_bad_config_before_training(tmp_path):
    env = {"PATH": f"{Path(__import__('sys').executable).parent}:/usr/bin:/bin", "RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(
        ["bash", str(ROOT / "launch/train_grpo.sh"), str(ROOT / "configs/examples/seed_6gpu_grpo.yaml"),
         "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert result.returncode == 2
    assert "must divide the 6 GPUs" in result.stderr
    assert not (tmp_path / "run" / "train.log").exists()


def test_worker_script_needs_the_head_address():
    result = subprocess.run(["bash", str(ROOT / "launch/ray_worker.sh")], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


# ---- the SLURM example, run with stand-ins for the cluster's commands ------------------------------------
# srun/scontrol/ray/hybridrl cannot run here (no Slurm, no GPUs): these stand-ins log what the
# script asks of them and with which environment. srun forwards SIGTERM to its step, as Slurm does.
STUBS = {
    "scontrol": 'printf "node-a\\nnode-b\\n"\n',
    "srun": ('echo "srun $*" >> "$STUB_DIR/srun"\n'
             'while [ "$#" -gt 0 ]; do case "$1" in -w) shift 2 ;; -*) shift ;; *) break ;; esac; done\n'
             '"$@" &\nchild=$!\ntrap \'pkill -TERM -P "$child"; kill -TERM "$child"\' TERM\nwait "$child"\n'),
    "ray": ('case "$1" in\n'
            '  start) echo "ray $* | NCCL_DEBUG=${NCCL_DEBUG:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}'
            ' TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-}'
            ' GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}" >> "$STUB_DIR/log"\n'
            '    case " $* " in *" --block "*) echo "$$" >> "$STUB_DIR/blocking"; exec sleep 60 ;; esac ;;\n'
            # as Ray's: exit 0 once the head's GCS answers, its node listed only once its raylet has started
            '  status) grep -q -- "--head" "$STUB_DIR/log" 2>/dev/null || exit 1\n'
            '    echo called >> "$STUB_DIR/status"\n'
            '    if [ "$(wc -l < "$STUB_DIR/status")" -lt 3 ]; then echo "No cluster status. It may take a few '
            'seconds for the Ray internal services to start up."\n'
            '    else printf "Node status\\nActive:\\n 1 node_4f0c2a\\n"; fi ;;\n'
            'esac\n'),
    # like the trainer, which waits (placement groups) until every node's GPUs have joined
    "hybridrl": ('for _ in $(seq 1 100); do alive=0\n'
                 '  for pid in $(cat "$STUB_DIR/blocking" 2>/dev/null); do '
                 'if kill -0 "$pid" 2>/dev/null; then alive=$((alive + 1)); fi; done\n'
                 '  if [ "$alive" -ge 2 ]; then break; fi; sleep 0.1\ndone\n'
                 'echo "hybridrl $1 ${*: -1} | RAY_ADDRESS=${RAY_ADDRESS:-} ray_nodes_alive=$alive" \\\n'
                 '  "status_calls=$(wc -l < "$STUB_DIR/status")" \\\n'
                 '  >> "$STUB_DIR/log"\n'),
}


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_slurm_script_exports_nccl_before_ray_and_keeps_its_nodes_alive(tmp_path):
    """Run on a multi-homed host (a network namespace whose first address is a docker-like bridge): the Ray
    nodes take the cluster address and its interface, every srun step asks for its CPUs and GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_CPUS_PER_TASK": "64", "SLURM_GPUS_PER_NODE": "h100:8",
           "NUM_GPUS": "8", "NCCL_SOCKET_IFNAME": "ib0", "RUN_DIR": str(tmp_path / "run")}
    try:
        with multi_homed_host() as host:
            assert subprocess.run(["ip", "netns", "exec", host, "hostname", "-I"], capture_output=True,
                                  text=True).stdout.split()[0] == BRIDGE_IP  # what the old script took
            result = subprocess.run(["ip", "netns", "exec", host, "bash", str(ROOT / "launch/slurm_grpo.sbatch"),
                                     "configs/examples/x.yaml"],
                                    capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        log = (tmp_path / "log").read_text().splitlines()
        starts = [line for line in log if line.startswith("ray start")]
        assert len(starts) == 2 and "--head" in starts[0] and f"--address={CLUSTER_IP}:6379" in starts[1]
        assert all(f"--node-ip-address={CLUSTER_IP}" in line for line in starts)
        # NCCL_SOCKET_IFNAME as the user set it; gloo's sockets on the interface of the cluster address
        nccl = "NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=ib0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 GLOO_SOCKET_IFNAME=eth9"
        for line in starts:  # every Ray node starts blocking, with the NCCL settings in its environment
            command, environment = line.split(" | ")
            assert command.endswith("--block") and environment == nccl, line
        trains = [line for line in log if line.startswith("hybridrl train")]
        # the job ran while both Ray nodes were still up, on the cluster the script started, once `ray status`
        # listed the head's node (its third answer: the first two, exit 0, only said the services were starting)
        assert trains == [f"hybridrl train trainer.nnodes=2 | RAY_ADDRESS={CLUSTER_IP}:6379 ray_nodes_alive=2 "
                          "status_calls=3"]
        steps = (tmp_path / "srun").read_text().splitlines()
        assert len(steps) == 3  # the head's address, the head, the worker
        assert all("--cpus-per-task=64" in step and "--gpus-per-node=8" in step for step in steps), steps
        blocking = [int(pid) for pid in (tmp_path / "blocking").read_text().split()]
        assert len(blocking) == 2
        deadline = time.monotonic() + 10  # signals are delivered asynchronously
        while any(map(_alive, blocking)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in blocking if _alive(pid)], "the script's exit stops its Ray steps"
    finally:
        for pid in (int(p) for p in (tmp_path / "blocking").read_text().split()) \
                if (tmp_path / "blocking").exists() else ():
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("args, env, expected", [
    (["--ifname", "10.9.0.1:6379"], {}, "10.9.0.2 eth9"),  # a worker: the address on its route to the head
    (["--ifname"], {}, "10.9.0.2 eth9"),  # the head: the default route's
    (["--ifname", "172.17.3.4"], {}, "172.17.0.1 br0"),  # a head reached over the bridge: that one
    (["--ifname"], {"NODE_IFNAME": "br0"}, "172.17.0.1 br0"),  # an explicit interface wins
    (["10.9.0.1"], {"NODE_IP": "10.9.0.7"}, "10.9.0.7"),  # an explicit address wins
])
def test_node_address_follows_the_route_not_the_first_address(args, env, expected):
    with multi_homed_host() as host:
        result = subprocess.run(["ip", "netns", "exec", host, "bash", str(ROOT / "launch/node_ip.sh"), *args],
                                capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_node_address_is_never_loopback():
    with multi_homed_host() as host:
        result = subprocess.run(["ip", "netns", "exec", host, "bash", str(ROOT / "launch/node_ip.sh"), "127.0.1.1"],
                                capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "set NODE_IP or NODE_IFNAME" in result.stderr
