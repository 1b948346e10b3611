"""hybridrl.parallel.state: layouts, ParallelContext contents, init/destroy life cycle."""
from __future__ import annotations

import pytest

from hybridrl.parallel import state
from tests.support.forked import free_port, run_ranks


# ------------------------------------------------------------------------------------------------
# pure layout validation
# ------------------------------------------------------------------------------------------------
def test_validate_layout_returns_dp():
    assert state.validate_layout(8, tp=2, pp=2) == 2
    assert state.validate_layout(8, tp=2, pp=2, cp=2) == 1
    assert state.validate_layout(4, tp=1, pp=2, vpp=2) == 2


def test_validate_layout_names_the_values():
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        state.validate_layout(6, tp=4)
    with pytest.raises(ValueError, match=r"tp=0"):
        state.validate_layout(4, tp=0)
    with pytest.raises(ValueError, match=r"vpp=2 .* needs pp >= 2"):
        state.validate_layout(4, pp=1, vpp=2)


def test_get_context_before_init_is_an_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        state.get_context()


def test_initialize_without_torch_distributed_is_an_error():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        state.initialize_model_parallel(tp=1)


# ------------------------------------------------------------------------------------------------
# ranks
# ------------------------------------------------------------------------------------------------
def _layout(rank: int, world_size: int, tp: int, pp: int, cp: int, vpp: int | None) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    ctx = state.initialize_model_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, seed=3)
    out = state.context_as_dict(ctx)
    out["same_as_get_context"] = state.get_context() is ctx
    for axis in ("tp", "pp", "cp", "dp", "dp_cp", "model_parallel"):
        out[f"{axis}_members"] = dist.get_process_group_ranks(getattr(ctx, f"{axis}_group"))
    out["first"], out["last"] = ctx.is_first_pp_stage, ctx.is_last_pp_stage
    out["megatron_vpp"] = mps.get_virtual_pipeline_model_parallel_world_size()
    out["describe"] = ctx.describe()
    return out


def test_context_tp2_pp2_dp2_on_8_ranks():
    outs = run_ranks(_layout, 8, 2, 2, 1, None, timeout_s=120)
    for rank, o in enumerate(outs):
        # megatron's default order "tp-cp-ep-dp-pp": tp fastest, pp slowest.
        assert (o["rank"], o["world_size"]) == (rank, 8)
        assert (o["tp"], o["pp"], o["cp"], o["dp"], o["vpp"]) == (2, 2, 1, 2, None)
        assert o["tp_rank"] == rank % 2
        assert o["dp_rank"] == (rank // 2) % 2
        assert o["pp_rank"] == rank // 4
        assert o["cp_rank"] == 0 and o["device"] == "cpu" and o["seed"] == 3
        assert o["tp_members"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert o["pp_members"] == [rank % 4, rank % 4 + 4]
        assert o["dp_members"] == [r for r in range(8) if r // 4 == rank // 4 and r % 2 == rank % 2]
        assert o["dp_cp_members"] == o["dp_members"]
        assert o["cp_members"] == [rank]
        assert len(o["model_parallel_members"]) == 4
        assert (o["first"], o["last"]) == (rank < 4, rank >= 4)
        assert o["same_as_get_context"]
    assert outs[5]["describe"] == "rank 5/8 on cpu: tp 1/2, pp 1/2, cp 0/1, dp 0/2"


def test_context_cp2_and_vpp():
    outs = run_ranks(_layout, 4, 1, 1, 2, None, timeout_s=120)
    for rank, o in enumerate(outs):
        assert (o["cp"], o["dp"], o["cp_rank"], o["dp_rank"]) == (2, 2, rank % 2, rank // 2)
        assert o["cp_members"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert o["dp_cp_members"] == [0, 1, 2, 3]
    outs = run_ranks(_layout, 2, 1, 2, 1, 2, timeout_s=120)
    assert [o["vpp"] for o in outs] == [2, 2] and [o["megatron_vpp"] for o in outs] == [2, 2]


def _subnormal_product() -> float:
    import torch

    return float(torch.tensor([1e-30]) * 1e-10)  # 1e-40: below fp32's smallest normal (1.18e-38)


def _lifecycle(rank: int, world_size: int) -> dict:
    out = {"subnormal_before": _subnormal_product()}
    try:
        state.initialize_model_parallel(tp=3)
    except ValueError as exc:
        out["bad_tp"] = str(exc)
    ctx = state.initialize_model_parallel(tp=2)
    out["subnormal_after"] = _subnormal_product()  # CPU policy: flushed to zero (DevicePolicy.flush_denormals)
    try:
        state.initialize_model_parallel(tp=2)
    except RuntimeError as exc:
        out["twice"] = str(exc)
    state.destroy_model_parallel()
    out["after_destroy"] = state.is_initialized()
    ctx2 = state.initialize_model_parallel(tp=1, pp=2)
    out["first"] = (ctx.tp, ctx.pp, ctx.dp)
    out["second"] = (ctx2.tp, ctx2.pp, ctx2.dp, ctx2.pp_rank)
    return out


def test_lifecycle_errors_and_reinit():
    outs = run_ranks(_lifecycle, 4, timeout_s=120)
    for rank, o in enumerate(outs):
        assert "world_size=4 is not divisible by tp*pp*cp = 3*1*1 = 3" in o["bad_tp"]
        assert "already initialized" in o["twice"]
        assert o["after_destroy"] is False
        assert o["first"] == (2, 1, 2)
        assert o["second"] == (1, 2, 2, rank // 2)
        assert o["subnormal_before"] > 0 and o["subnormal_after"] == 0.0


def _init_distributed_cases(rank: int, world_size: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    out = {"same_world": state.init_distributed(rank, world_size, device="cpu")}
    try:
        state.init_distributed(rank, world_size + 1)
    except RuntimeError as exc:
        out["other_world"] = str(exc)
    try:
        state.init_distributed(rank, world_size, device="cuda")
    except RuntimeError as exc:
        out["cuda"] = str(exc)
    # A fresh group through init_distributed itself (the launcher's group torn down first).
    dist.destroy_process_group()
    out["fresh"] = state.init_distributed(rank, world_size, "127.0.0.1", port, device="cpu", timeout_s=30)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    return out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA error")
def test_init_distributed():
    outs = run_ranks(_init_distributed_cases, 2, free_port(), timeout_s=120)
    for o in outs:
        assert o["same_world"] == "gloo"
        assert "already initialized as rank" in o["other_world"]
        assert "CUDA is not available" in o["cuda"]
        assert o["fresh"] == "gloo" and o["sum"] == 3.0


# ------------------------------------------------------------------------------------------------
# process-group timeouts (trainer.nccl_timeout_s reaches megatron's groups)
# ------------------------------------------------------------------------------------------------
LAUNCHER_TIMEOUT_S = 420  # the world group's, set by run_ranks: 7 whole minutes


CASES_S = {"world-group-default": (None, LAUNCHER_TIMEOUT_S), "explicit": (1800.0, 1800.0),
           "rounded-up-to-minutes": (61.0, 120.0)}  # (timeout_s passed, what every megatron group gets)


def _group_timeouts(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as mps

    out = {"world": state.process_group_timeout_s()}
    for case, (explicit_s, _) in CASES_S.items():
        ctx = state.initialize_model_parallel(tp=2, pp=1, device="cpu", timeout_s=explicit_s)
        try:
            groups = {"tp": ctx.tp_group, "pp": ctx.pp_group, "dp": ctx.dp_group, "cp": ctx.cp_group,
                      "model_parallel": ctx.model_parallel_group, "embedding": mps.get_embedding_group()}
            out[case] = {name: state.process_group_timeout_s(group) for name, group in groups.items()}
        finally:
            state.destroy_model_parallel()
    return out


def test_megatron_groups_take_the_requested_timeout():
    # megatron's own default (distributed_timeout_minutes=30) would give 1800 s to every group
    outs = run_ranks(_group_timeouts, 2, timeout_s=LAUNCHER_TIMEOUT_S)
    for rank, out in enumerate(outs):
        assert out["world"] == LAUNCHER_TIMEOUT_S
        for case, (_, expected_s) in CASES_S.items():
            assert out[case] == dict.fromkeys(out[case], expected_s), (rank, case, out[case])
