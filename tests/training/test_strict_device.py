"""The CPU guard for the GPU path: the workers' real data path under strict-device mode.

Strict-device mode (`hybridrl.parallel.cpu.strict_device`) makes the CPU layer remember which tensors
would live on the GPU (what megatron and our code put "on cuda") and raise where CUDA would: a
host batch fed to a model on the device, a host tensor in a collective on a group that is NCCL on
GPUs. The batches here arrive as the controller sends them (a `Batch` pickled through numpy:
host tensors), so every worker entry point must move its micro-batches to the rank's device and
bring its results back. The numbers are checked against the same references as the plain tests
(transformers, plain torch, a single-rank run without strict mode).

`HYBRIDRL_STRICT_DEVICE=1` in pytest's environment runs any other worker test under the same mode.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridrl.parallel.cpu import strict_device
from hybridrl.workers.probe import RARE_TOKEN_PROBE
from tests.support.forked import RankError, run_ranks
from tests.support.training_fixtures import (
    hf_response_log_probs,
    job_config,
    policy_model,
    rollout_batch,
    sequence_classifier,
    update_rank,
    with_critic,
    with_reward_model,
)
from tests.support.value_models import critic_rank, reference_critic, reward_rank

TOL = 1e-5


def _strict_rank(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(rank, world, *args)` with strict-device mode on from the start (before megatron's groups)."""
    strict_device.enable_strict_device()
    result = fn(rank, world, *args)
    _assert_on_host(result)
    return result


def _assert_on_host(value: Any) -> None:
    """What a worker hands back to the controller must be host memory (a CPU-only driver reads it)."""
    if isinstance(value, torch.Tensor):
        assert strict_device.placement(value) != "device", "a result for the controller was left on the device"
    elif isinstance(value, dict):
        for item in value.values():
            _assert_on_host(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _assert_on_host(item)


@pytest.fixture
def strict_mode():
    strict_device.enable_strict_device()
    try:
        with strict_device.StrictDeviceMode():
            yield
    finally:
        strict_device.disable_strict_device()


# ------------------------------------------------------------------------------- the mode itself
def test_strict_mode_raises_where_cuda_would(strict_mode):
    weight = torch.nn.Parameter(torch.randn(10, 4, device="cuda"))  # as megatron allocates
    ids = torch.from_numpy(np.array([[1, 2, 3]]))  # as a Batch arrives from the controller
    assert strict_device.placement(weight) == "device" and strict_device.placement(ids) == "host"
    with pytest.raises(strict_device.DeviceMismatch, match="embedding"):
        F.embedding(ids, weight)
    on_device = ids.to("cuda")
    assert strict_device.placement(ids) == "host"  # the move made a new tensor; the source stays
    out = F.embedding(on_device, weight)
    assert strict_device.placement(out) == "device"
    assert torch.equal(out, weight[ids[0]].unsqueeze(0))  # the numbers are those of the plain op
    scaled = out * torch.tensor(2.0)  # 0-dim CPU tensors are fine next to CUDA ones
    assert strict_device.placement(scaled) == "device"
    with pytest.raises(strict_device.DeviceMismatch, match="mul"):
        out * torch.ones(1, 3, 4)
    with pytest.raises(strict_device.DeviceMismatch, match="numpy"):
        out.numpy()
    back = out.cpu()
    assert strict_device.placement(back) == "host" and torch.equal(back, out.cpu())
    assert strict_device.placement(out[torch.tensor([0])]) == "device"  # host indices are fine
    # a host tensor indexed by device indices raises on CUDA (a 0-dim index is read as a number)
    rows, picks = torch.arange(6).reshape(3, 2), torch.tensor([0, 2], device="cuda")
    with pytest.raises(strict_device.DeviceMismatch, match="indices should be either on cpu"):
        rows[picks]
    with pytest.raises(strict_device.DeviceMismatch, match="indices should be either on cpu"):
        rows[(slice(None), picks[:1])]
    with pytest.raises(strict_device.DeviceMismatch, match="indices should be either on cpu"):
        rows[picks] = 0
    assert torch.equal(rows[torch.tensor(1, device="cuda")], torch.tensor([2, 3]))
    out.sum().backward()
    assert weight.grad is not None  # autograd's tensors are never judged (unknown), so no false alarm


def test_untagged_tensors_are_judged_by_where_they_came_from(strict_mode):
    """Tensors no tagged op made: `device=t.device` allocations and `x.to(t.device)` land where `t` is,
    autograd's gradients live where their parameter lives, a tensor rebuilt from a pickle is a host tensor."""
    import pickle

    weight = torch.nn.Parameter(torch.randn(3, 4, device="cuda"))
    host = torch.ones(3, 4)
    for made in (torch.zeros(3, 4, device=weight.device), torch.empty_like(host, device=weight.device),
                 host.to(weight.device)):
        assert strict_device.placement(made) == "device"
        with pytest.raises(strict_device.DeviceMismatch, match="add"):
            made + host
    assert strict_device.placement(torch.zeros(2, device=host.device)) == "host"
    assert weight.device.type == "cpu" and str(weight.device) == "cpu:0"  # a CPU tensor, on the would-be GPU
    (weight * 2).sum().backward()
    assert strict_device.placement(weight.grad) == "device"
    with pytest.raises(strict_device.DeviceMismatch, match="mul"):
        weight.grad * host
    back = pickle.loads(pickle.dumps(weight.detach().cpu()))  # as a Ray message or a checkpoint arrives
    assert strict_device.placement(back) == "host" and torch.equal(back, weight.detach().cpu())
    with pytest.raises(strict_device.DeviceMismatch, match="matmul"):
        back @ weight.T


def test_placement_helpers_answer_for_the_gpu_under_strict_mode():
    from hybridrl.parallel.device import megatron_cpu_initialization, rank_device, to_rank_device

    assert rank_device("cpu") == torch.device("cpu") and megatron_cpu_initialization("cpu")
    assert not megatron_cpu_initialization("cuda")
    with pytest.raises(ValueError, match="'gpu'"):
        rank_device("gpu")
    strict_device.enable_strict_device()
    try:
        with strict_device.StrictDeviceMode():
            # "cuda", which the CPU layer maps to the CPU while tagging the tensor as a device tensor
            assert rank_device("cpu") == torch.device("cuda", 0)
            assert not megatron_cpu_initialization("cpu")  # parameters are allocated "on the device"
            host = torch.arange(4)
            moved = to_rank_device(host, "cpu")
            assert moved.device.type == "cpu" and torch.equal(moved.cpu(), host)
            assert strict_device.placement(moved) == "device" and strict_device.placement(host) == "host"
    finally:
        strict_device.disable_strict_device()
    assert rank_device("cpu") == torch.device("cpu")


def _collective_rank(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist

    from hybridrl.parallel.device import collective_device

    strict_device.enable_strict_device()
    host_group = dist.new_group([0, 1], backend="gloo")  # megatron's CPU-side groups are made like this
    nccl_like = dist.new_group([0, 1])
    outcome = {}
    with strict_device.StrictDeviceMode():
        for name, group in (("default", None), ("new_group", nccl_like), ("gloo", host_group)):
            try:
                dist.all_reduce(torch.ones(2), group=group)
                outcome[name] = "ok"
            except strict_device.DeviceMismatch as error:
                outcome[name] = str(error)
        total = torch.full((2,), float(rank + 1), device=collective_device(nccl_like))
        dist.all_reduce(total, group=nccl_like)
        outcome["collective_device"] = str(total.tolist())
        # gloo takes CUDA tensors for all_reduce and broadcast only (torch.distributed's backend table)
        dist.all_reduce(torch.ones(2, device="cuda"), group=host_group)
        try:
            dist.all_gather_into_tensor(torch.empty(4, device="cuda"), torch.ones(2, device="cuda"), group=host_group)
            outcome["gloo_device_gather"] = "ok"
        except strict_device.DeviceMismatch as error:
            outcome["gloo_device_gather"] = str(error)
        ops = [dist.P2POp(dist.isend, torch.ones(3), 1 - rank), dist.P2POp(dist.irecv, torch.empty(3), 1 - rank)]
        try:
            dist.batch_isend_irecv(ops)
            outcome["p2p"] = "ok"
        except strict_device.DeviceMismatch as error:
            outcome["p2p"] = str(error)
    return outcome


def test_collectives_refuse_host_tensors_on_nccl_groups():
    for outcome in run_ranks(_collective_rank, 2):
        assert "all_reduce" in outcome["default"] and "NCCL" in outcome["default"]
        assert "all_reduce" in outcome["new_group"]
        assert outcome["gloo"] == "ok"
        assert outcome["collective_device"] == "[3.0, 3.0]"
        assert "batch_isend_irecv" in outcome["p2p"]
        assert "all_gather_into_tensor" in outcome["gloo_device_gather"] and "gloo" in outcome["gloo_device_gather"]


def _megatron_bound_collective_rank(rank: int, world: int) -> dict[str, str]:
    """megatron's own TP gather and reduce-scatter (names bound when megatron was imported, before strict
    mode: the fork server preloads megatron) on a host tensor, and on a device one."""
    import megatron.core.tensor_parallel.mappings as mappings

    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    assert "megatron.core.tensor_parallel.mappings" in sys.modules  # bound before the mode exists
    strict_device.enable_strict_device()
    initialize_model_parallel(tp=2, device="cpu")
    outcome = {}
    try:
        with strict_device.StrictDeviceMode():
            for name, call in (("all_gather", mappings.gather_from_sequence_parallel_region),
                               ("reduce_scatter", mappings.reduce_scatter_to_sequence_parallel_region)):
                for where, tensor in (("host", torch.ones(4, 3)), ("device", torch.ones(4, 3, device="cuda"))):
                    try:
                        call(tensor)
                        outcome[f"{name}/{where}"] = "ok"
                    except strict_device.DeviceMismatch as error:
                        outcome[f"{name}/{where}"] = str(error)
    finally:
        destroy_model_parallel()
        strict_device.disable_strict_device()
    return outcome


def test_megatrons_import_time_collectives_are_checked():
    """A host tensor in megatron's sequence-parallel gather / reduce-scatter raises as NCCL would (these go
    through names megatron bound at import, `mappings.dist_all_gather_func` / `dist_reduce_scatter_func`);
    the same call on a device tensor runs."""
    for outcome in run_ranks(_megatron_bound_collective_rank, 2):
        for name, collective in (("all_gather", "all_gather_into_tensor"), ("reduce_scatter", "reduce_scatter_tensor")):
            assert collective in outcome[f"{name}/host"] and "NCCL" in outcome[f"{name}/host"], outcome
            assert outcome[f"{name}/device"] == "ok", outcome


# ------------------------------------------------------------------------ the workers' data path
def _actor_log_prob_rank(rank: int, world: int, config: Any, batch: Any) -> Any:
    from hybridrl.config.plan import build_plan
    from hybridrl.reshard.resharder import Resharder
    from hybridrl.training.actor import MegatronActor
    from hybridrl.training.backend import MegatronBackend, role_spec
    from hybridrl.workers.probe import probe_batch

    strict_device.enable_strict_device()
    assert strict_device.placement(batch["input_ids"]) == "host"  # as it arrives from the controller
    plan = build_plan(config)
    backend = MegatronBackend(role_spec(plan, "actor"))
    assert all(strict_device.placement(p) == "device" for c in backend.chunks for p in c.parameters())
    actor = MegatronActor(backend, plan, output_key="old_log_probs")
    out = actor.compute_log_prob(batch, with_entropy=True)
    probe = actor.compute_log_prob(probe_batch(RARE_TOKEN_PROBE, 0))  # the sync's log-prob probe, trainer side
    shards = Resharder(backend.chunks, plan.reshard.groups).reshard()
    if out is not None:
        assert all(strict_device.placement(t) != "device" for t in (*out.tensors.values(), *probe.tensors.values())), \
            "results for the controller must come back to the host"
    strict_device.disable_strict_device()
    plain = Resharder(backend.chunks, plan.reshard.groups).reshard()
    same_shards = sorted(shards) == sorted(plain) and all(torch.equal(shards[k], plain[k]) for k in plain)
    result = None if out is None else {k: v.clone() for k, v in out.tensors.items()}
    return {"out": result, "probe": None if probe is None else probe["old_log_probs"].clone(),
            "same_shards": same_shards, "shards": len(shards)}


def _probe_reference(hf_dir: Any) -> torch.Tensor:
    """transformers' log-probs of the sync probe's response (one unpadded row)."""
    import transformers

    probe = RARE_TOKEN_PROBE
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    ids = torch.tensor([probe.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(probe.prompt) - 1: -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe.response).unsqueeze(-1)).T


def test_actor_log_probs_probe_and_resharder_under_strict_device(tmp_path):

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    ref_lp, ref_ent = hf_response_log_probs(hf, batch)
    probe_ref = _probe_reference(hf)
    # TP2: vocab-parallel log-probs and entropy reduce over the TP group; the resharder gathers the
    # TP shards into the rollout's single-GPU layout with point-to-point messages.
    results = run_ranks(_actor_log_prob_rank, 2, job_config(hf, world=2, tp=2), batch)
    outs = [r for r in results if r["out"] is not None]
    assert len(outs) == 1
    assert torch.allclose(outs[0]["out"]["old_log_probs"], ref_lp, atol=TOL, rtol=0)
    assert torch.allclose(outs[0]["out"]["entropys"], ref_ent, atol=TOL, rtol=0)
    assert torch.allclose(outs[0]["probe"], probe_ref, atol=TOL, rtol=0)
    assert all(r["same_shards"] and r["shards"] > 0 for r in results)


def test_ppo_update_under_strict_device_equals_a_plain_single_rank_run(tmp_path):
    """DP2 with megatron's distributed optimizer and token-budget micro-batches (their count agreed
    over DP), KL and entropy terms: every DP collective of the update runs on device tensors."""
    from tests.support.models_fixtures import safetensors_state

    hf = policy_model(tmp_path / "hf")
    batch = rollout_batch(8)
    knobs = dict(use_kl_loss=True, entropy_coeff=0.01, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)
    strict = run_ranks(_strict_rank, 2, update_rank, job_config(hf, world=2, distributed_optimizer=True, **knobs),
                       batch, str(tmp_path / "strict"))
    (plain,) = run_ranks(update_rank, 1, job_config(hf, world=1, **knobs), batch, str(tmp_path / "plain"))
    metrics = [r["metrics"] for r in strict if r["metrics"] is not None]
    assert len(metrics) == 2
    for name in ("pg_loss", "grad_norm", "kl_loss", "entropy", "clipfrac"):
        assert abs(getattr(metrics[0], name) - getattr(plain["metrics"], name)) < TOL, name
    state, reference = safetensors_state(tmp_path / "strict"), safetensors_state(tmp_path / "plain")
    assert max((state[n] - reference[n]).abs().max() for n in reference) < TOL
    initial = safetensors_state(hf)
    assert max((reference[n] - initial[n]).abs().max() for n in initial) > 1e-3  # the step moved weights


def test_critic_and_reward_model_under_strict_device(tmp_path):
    import transformers

    rm = sequence_classifier(tmp_path / "rm")
    hf = policy_model(tmp_path / "policy")
    batch = rollout_batch(8)
    ref = reference_critic(rm, batch)
    # DP2: values, the update's normalizers and metric sums all reduce over the DP group.
    config = with_critic(job_config(hf, world=2), rm)
    outs = [o for o in run_ranks(_strict_rank, 2, critic_rank, config, batch) if o is not None]
    assert len(outs) == 2
    assert (torch.cat([o["before"] for o in outs]) - ref["before"]).abs().max() < TOL
    assert abs(outs[0]["metrics"].vf_loss - ref["loss"]) < TOL
    assert abs(outs[0]["metrics"].grad_norm - ref["grad_norm"]) < TOL
    assert (torch.cat([o["after"] for o in outs]) - ref["after"]).abs().max() < TOL

    model = transformers.LlamaForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                        attn_implementation="eager")
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).logits.squeeze(-1)
    config = with_reward_model(job_config(hf, world=2), rm, tp=2)
    scores = [s for s in run_ranks(_strict_rank, 2, reward_rank, config, batch) if s is not None]
    assert len(scores) == 1
    assert (scores[0] - expected).abs().max() < TOL


# ------------------------------------------------------------------ the lane's negative controls
# `make test` runs the whole suite under strict-device mode (tests/conftest.py sets HYBRIDRL_STRICT_DEVICE=1): every
# multi-rank worker, trainer, resharder, cross-pool, MoE, CP and rollout test passes with the guard on. Each
# control below plants ONE host tensor where a path's own code puts a tensor on the device (the line "forgot the
# device": `strict_device.plant_host_tensor`) and shows the guard then stops that path as CUDA would.
def _planted_rank(rank: int, world: int, where: str, fn: Callable[..., Any], *args: Any) -> Any:
    strict_device.enable_strict_device()
    strict_device.plant_host_tensor(where)
    return fn(rank, world, *args)


def _cross_pool_send_rank(rank: int, world: int) -> str:
    """Member 0 (trainer side) sends the rollout member a tensor its code put "on the device"."""
    from hybridrl.parallel.cpu.layer import apply_cpu_layer
    from hybridrl.parallel.cross_group import CrossGroup, CrossGroupAddress, open_store
    from tests.support.forked import free_port

    apply_cpu_layer()  # (a worker's process has it from its megatron set-up)

    port = torch.tensor([free_port() if rank == 0 else 0])
    torch.distributed.broadcast(port, 0, group=torch.distributed.new_group([0, 1], backend="gloo"))
    address = CrossGroupAddress("127.0.0.1", int(port), 1, 1)
    store = open_store("127.0.0.1", 2, 60, port=int(port)) if rank == 0 else None
    group = CrossGroup(address, rank, "gloo", 60, store=store)
    # both sides joined before either goes on: the rollout member leaving at once could close its end of gloo's
    # full mesh while the trainer member was still connecting ("Connection closed by peer", seen in a full run)
    torch.distributed.barrier()
    if rank == 1:
        return "joined"  # (the receiving side is vLLM's, judged by vLLM's own device: not waited on here)
    group.send(torch.ones(4, device="cuda"), 1).wait()
    return "sent"


def _moe_config(tmp_path: Any) -> Any:
    from tests.support.models_fixtures import make_hf_model

    config = job_config(make_hf_model(tmp_path / "moe", "qwen3_moe", seed=7), world=2, micro=4)
    config.actor_rollout_ref.actor.megatron.expert_model_parallel_size = 2
    return config


def _cp_config(tmp_path: Any) -> Any:
    from tests.support.rank_passes import with_cp

    return with_cp(job_config(policy_model(tmp_path / "hf"), world=2, micro=4), 2, False)


def _planted_cases(tmp_path: Any) -> dict[str, tuple[str, int, Callable[..., Any], tuple]]:
    """path -> (where the host tensor is planted: module[:function], world, rank function, its arguments)."""
    from tests.support.rank_passes import log_prob_rank
    from tests.support.reshard_ranks import deliver_rank, reshard_rank
    from tests.support.rollout_models import QWEN2_TIED, build_tiny_model

    hf = str(policy_model(tmp_path / "policy"))
    served = str(build_tiny_model(tmp_path / "served", {**QWEN2_TIED, "eos_token_id": None, "bos_token_id": None},
                                  seed=11))  # a model vLLM serves at its context length
    batch = rollout_batch(8)
    return {
        # the worker's micro-batches, moved to the rank's device by the training backend
        "worker": ("hybridrl.training.backend:micro_batches", 1, log_prob_rank,
                   (job_config(hf, world=1, micro=4), batch)),
        # the resharder's send and receive buffers of a bucket (TP2 -> one TP1 vLLM rank; its outputs may be host: vLLM
        # copies them in, as on GPUs)
        "resharder": ("hybridrl.reshard.exchange:_run_bucket", 2, reshard_rank, (hf, 2, 1, None, 1, 16 << 10)),
        # the hybrid engine's sync into a live vLLM engine in the same process
        "rollout": ("hybridrl.reshard.exchange:_run_bucket", 2, deliver_rank, (served, 2, 1, 1)),
        # megatron's own MoE code (router, token dispatcher at EP2)
        "moe": ("megatron.core.transformer.moe", 2, log_prob_rank, (_moe_config(tmp_path), batch)),
        # context parallelism: the attention stand-in's key positions of the CP-gathered keys and values
        "cp": ("hybridrl.parallel.cpu.attention", 2, log_prob_rank, (_cp_config(tmp_path), batch)),
        # the cross-pool group's trainer side (its process group is used directly, not through torch.distributed)
        "cross-pool": ("tests.training.test_strict_device", 2, _cross_pool_send_rank, ()),
    }


PLANTED_PATHS = ("worker", "resharder", "rollout", "moe", "cp", "cross-pool")


@pytest.mark.parametrize("path", PLANTED_PATHS)
def test_a_planted_host_tensor_stops_each_path(tmp_path, path):
    where, world, fn, args = _planted_cases(tmp_path)[path]
    with pytest.raises(RankError) as info:
        run_ranks(_planted_rank, world, where, fn, *args, timeout_s=300)
    assert "DeviceMismatch: strict-device:" in info.value.detail and "host tensor" in info.value.detail, \
        info.value.detail[-3000:]
