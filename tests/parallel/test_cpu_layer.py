"""Each patch of the CPU layer: what fails without it, and the behaviour it enables.

Patches are process-wide, so every check runs in forked ranks (fresh processes from the launcher's
server, which never applies the layer); the pytest process itself stays unpatched.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridrl.parallel.cpu import layer as cpu_layer
from tests.support.forked import run_ranks

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the 'fails without the patch' halves assume a CPU-only torch"
)


def _raises(fn) -> str:
    """Run fn; return '' if it succeeded, else 'ExcType: message'."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return f"{type(exc).__name__}: {exc}"
    return ""


def _init_megatron_groups(tp: int = 1) -> None:
    from megatron.core import parallel_state as mps

    mps.initialize_model_parallel(tensor_model_parallel_size=tp)


def _column_linear(use_cpu_initialization: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=use_cpu_initialization,
        **cpu_layer.CPU_CONFIG_OVERRIDES,
    )
    return ColumnParallelLinear(
        8, 16, config=config, init_method=torch.nn.init.normal_, bias=False, gather_output=False,
    )


# ------------------------------------------------------------------------------------------------
# version check, idempotence, removal
# ------------------------------------------------------------------------------------------------
def test_version_check():
    assert cpu_layer.check_megatron_version("0.16.1") == "0.16.1"
    with pytest.raises(cpu_layer.UnsupportedMegatronVersion, match=r"0\.16\.x.*0\.17\.0 is installed"):
        cpu_layer.check_megatron_version("0.17.0")
    with pytest.raises(cpu_layer.UnsupportedMegatronVersion):
        cpu_layer.check_megatron_version("0.15.3")


def _apply_with_wrong_version(rank: int, world_size: int) -> tuple[str, list[str]]:
    import megatron.core

    megatron.core.__version__ = "0.15.0"
    return _raises(cpu_layer.apply_cpu_layer), cpu_layer.active_patches()


def test_apply_refuses_other_megatron_version_and_patches_nothing():
    error, active = run_ranks(_apply_with_wrong_version, 1, timeout_s=120)[0]
    assert error.startswith("UnsupportedMegatronVersion") and "0.15.0 is installed" in error
    assert active == []


def _apply_twice_then_remove(rank: int, world_size: int) -> dict:
    from torch.overrides import _get_current_function_mode_stack

    def modes() -> int:
        return sum(isinstance(m, cpu_layer.CudaToCpuMode) for m in _get_current_function_mode_stack())

    out = {"before": cpu_layer.cpu_layer_active()}
    first = cpu_layer.apply_cpu_layer()
    second = cpu_layer.apply_cpu_layer()
    out.update(first=first, second=second, active=cpu_layer.cpu_layer_active(), modes=modes(),
               device_ok=_raises(torch.cuda.current_device) == "")
    cpu_layer.remove_cpu_layer()
    out.update(after=cpu_layer.active_patches(), modes_after=modes(),
               device_after=_raises(torch.cuda.current_device))
    return out


def test_apply_is_idempotent_and_removable():
    out = run_ranks(_apply_twice_then_remove, 1, timeout_s=120)[0]
    assert out["before"] is False
    assert out["first"] == out["second"] == list(cpu_layer.PATCHES)
    assert out["active"] is True and out["modes"] == 1 and out["device_ok"]
    assert out["after"] == [] and out["modes_after"] == 0
    assert "not compiled with CUDA" in out["device_after"]


def test_unknown_skip_name_is_rejected():
    with pytest.raises(ValueError, match="unknown CPU-layer patches"):
        cpu_layer.apply_cpu_layer(skip=["no_such_patch"])


def test_describe_patches_covers_all():
    assert list(cpu_layer.describe_patches()) == list(cpu_layer.PATCHES)


# ------------------------------------------------------------------------------------------------
# cuda_current_device
# ------------------------------------------------------------------------------------------------
def _plain_layer() -> None:
    """This rank checks the plain cuda -> cpu mapping (device "cpu"): the strict-device lane's mode answers
    "cpu:0" for a tensor on the would-be GPU (tests/training/test_strict_device.py checks that mode)."""
    import os

    os.environ["HYBRIDRL_STRICT_DEVICE"] = "0"


def _linear_with_and_without_current_device(rank: int, world_size: int) -> dict:
    from megatron.core import tensor_parallel

    _plain_layer()
    _init_megatron_groups()
    cpu_layer.apply_cpu_layer(skip=["cuda_current_device"])
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    without = _raises(lambda: _column_linear(use_cpu_initialization=False))
    cpu_layer.apply_cpu_layer()
    layer = _column_linear(use_cpu_initialization=False)
    return {"without": without, "device": str(layer.weight.device), "shape": tuple(layer.weight.shape),
            "index": torch.cuda.current_device()}


def test_cuda_current_device_patch():
    out = run_ranks(_linear_with_and_without_current_device, 1, timeout_s=120)[0]
    # megatron's GPU-style init allocates on torch.cuda.current_device(): fails without the patch.
    assert "not compiled with CUDA" in out["without"]
    assert out["device"] == "cpu" and out["shape"] == (16, 8) and out["index"] == 0


# ------------------------------------------------------------------------------------------------
# cuda_to_cpu_mode
# ------------------------------------------------------------------------------------------------
def _device_mapping(rank: int, world_size: int) -> dict:
    from megatron.core.transformer.utils import get_default_causal_mask

    _plain_layer()  # (the strict-device mode also hands `.cuda()` back as a new tensor, to hold its placement)
    cpu_layer.apply_cpu_layer(skip=["cuda_to_cpu_mode"])
    out = {
        "mask_without": _raises(lambda: get_default_causal_mask(4)),
        "index_alloc_without": _raises(lambda: torch.empty(2, device=torch.cuda.current_device())),
    }
    cpu_layer.apply_cpu_layer()
    t = torch.arange(3.0)
    out.update(
        mask=get_default_causal_mask(4),
        zeros=str(torch.zeros(2, device="cuda:0").device),
        dev_obj=str(torch.ones(1, device=torch.device("cuda")).device),
        index=str(torch.empty(1, device=torch.cuda.current_device()).device),
        cuda_is_self=t.cuda() is t,
        to_cuda=str(t.to("cuda").device),
        to_cuda_dtype=(str(t.to("cuda", torch.float64).device), str(t.to("cuda", torch.float64).dtype)),
        to_dtype=str(t.to(torch.float16).dtype),
        to_kw=str(t.to(device="cuda").device),
        like=str(torch.zeros_like(t, device="cuda").device),
    )
    return out


def test_cuda_to_cpu_mode_patch():
    out = run_ranks(_device_mapping, 1, timeout_s=120)[0]
    # get_default_causal_mask hard-codes device="cuda" (used when GPTModel gets attention_mask=None).
    assert "not compiled with CUDA" in out["mask_without"]
    assert "Cannot access accelerator device" in out["index_alloc_without"]  # device=0 means cuda:0
    expected = torch.triu(torch.ones(4, 4), diagonal=1).bool()
    assert out["mask"].device.type == "cpu" and torch.equal(out["mask"], expected)
    assert out["zeros"] == out["dev_obj"] == out["index"] == out["to_cuda"] == out["to_kw"] == "cpu"
    assert out["like"] == "cpu"
    assert out["cuda_is_self"] is True
    assert out["to_cuda_dtype"] == ("cpu", "torch.float64")
    assert out["to_dtype"] == "torch.float16"  # non-device arguments of .to() are left alone


def _yarn_rotary_device_index(rank: int, world_size: int, strict: bool) -> dict:
    """megatron's YarnRotaryEmbedding built as on a GPU (`use_cpu_initialization=False`: its `__init__` enters
    `torch.device(torch.cuda.current_device())`), without and with the mapping of that bare index, against the same
    module built on the host (`use_cpu_initialization=True`, no device context)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from hybridrl.parallel.cpu import strict_device

    if not strict:
        _plain_layer()
    _init_megatron_groups()
    cpu_layer.apply_cpu_layer()
    kwargs = dict(kv_channels=16, rotary_base=10000.0, scaling_factor=4.0, original_max_position_embeddings=32)
    host = YarnRotaryEmbedding(**kwargs, use_cpu_initialization=True)(100)[0]
    saved = cpu_layer.cuda_ordinal_device
    cpu_layer.cuda_ordinal_device = strict_device.cuda_ordinal_device = lambda *args: None
    try:
        without = _raises(lambda: YarnRotaryEmbedding(**kwargs, use_cpu_initialization=False))
    finally:
        cpu_layer.cuda_ordinal_device = strict_device.cuda_ordinal_device = saved
    as_on_gpu = YarnRotaryEmbedding(**kwargs, use_cpu_initialization=False)(100)[0]
    return {"without": without, "same": torch.equal(as_on_gpu.cpu(), host.cpu()),
            "device": str(torch.device(0)), "strict": strict_device.strict_device_active()}


@pytest.mark.parametrize("strict", [False, True])
def test_cuda_to_cpu_mode_maps_a_bare_device_index(strict):
    out = run_ranks(_yarn_rotary_device_index, 1, strict, timeout_s=120)[0]
    # a CPU-only torch cannot resolve torch.device(0) (the current accelerator's device 0)
    assert "Cannot access accelerator device" in out["without"]
    assert out["device"] == "cuda:0" and out["strict"] is strict
    assert out["same"]  # megatron's own YaRN angles, as built on the host


def _sequence_parallel_backward(rank: int, world_size: int) -> dict:
    from megatron.core import tensor_parallel

    from hybridrl.parallel.state import initialize_model_parallel

    initialize_model_parallel(tp=2)
    # [s/tp, b, h] shard -> all-gather along the sequence; its backward reduce-scatters into a buffer
    # allocated with device=torch.cuda.current_device() inside a custom autograd backward.
    # on the device, as megatron's activations are (the strict-device lane checks it)
    x = torch.full((2, 1, 3), float(rank + 1), requires_grad=True, device="cuda")
    y = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
    weights = torch.arange(4.0, device="cuda").reshape(4, 1, 1)
    (y * weights).sum().backward()
    x2 = torch.full((2, 1, 3), 1.0, requires_grad=True, device="cuda")
    y2 = tensor_parallel.gather_from_sequence_parallel_region(x2, tensor_parallel_output_grad=True)
    (grad,) = torch.autograd.grad((y2 * weights).sum(), [x2])
    return {"y": y.detach().cpu(), "grad": x.grad.cpu(), "autograd_grad": grad.cpu()}


def test_cuda_to_cpu_mode_covers_backward_allocations():
    outs = run_ranks(_sequence_parallel_backward, 2, timeout_s=120)
    for rank, o in enumerate(outs):
        assert torch.equal(o["y"][:, 0, 0], torch.tensor([1.0, 1.0, 2.0, 2.0]))
        # d/dx of sum(w * y) reduce-scattered over 2 identical TP ranks: 2 * w[rank's rows]
        expected = 2 * torch.arange(4.0)[2 * rank: 2 * rank + 2].reshape(2, 1, 1).expand(2, 1, 3)
        assert torch.equal(o["grad"], expected)
        assert torch.equal(o["autograd_grad"], expected)


def _other_thread(rank: int, world_size: int) -> dict:
    import threading

    _plain_layer()
    cpu_layer.apply_cpu_layer()
    out: dict = {"main_active": cpu_layer.cpu_layer_active()}

    def worker() -> None:
        out["thread_active_before"] = cpu_layer.cpu_layer_active()
        out["thread_before"] = _raises(lambda: torch.zeros(1, device="cuda"))
        cpu_layer.apply_cpu_layer()
        out["thread_active_after"] = cpu_layer.cpu_layer_active()
        out["thread_after"] = str(torch.zeros(1, device="cuda").device)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return out


def test_cuda_to_cpu_mode_is_per_thread():
    out = run_ranks(_other_thread, 1, timeout_s=120)[0]
    assert out["main_active"] is True
    # Torch function modes are thread-local: a new thread needs its own apply_cpu_layer().
    assert out["thread_active_before"] is False and "not compiled with CUDA" in out["thread_before"]
    assert out["thread_active_after"] is True and out["thread_after"] == "cpu"


def _suspend_mode(rank: int, world_size: int) -> dict:
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    _plain_layer()

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cpu_layer.apply_cpu_layer()
    out: dict = {}
    with cpu_layer.cuda_to_cpu_mode_suspended():
        out["inside"] = _raises(lambda: torch.zeros(1, device="cuda"))
        out["stack_inside"] = len(_get_current_function_mode_stack())
    out["after"] = str(torch.zeros(1, device="cuda").device)
    with PassThrough():  # not ours on top: the stack is left alone
        with cpu_layer.cuda_to_cpu_mode_suspended():
            out["under_other_mode"] = str(torch.zeros(1, device="cuda").device)
    return out


def test_cuda_to_cpu_mode_can_be_suspended_for_code_that_never_calls_megatron():
    out = run_ranks(_suspend_mode, 1, timeout_s=120)[0]
    assert "not compiled with CUDA" in out["inside"] and out["stack_inside"] == 0
    assert out["after"] == "cpu" and out["under_other_mode"] == "cpu"


# ------------------------------------------------------------------------------------------------
# cpu_rng_tracker
# ------------------------------------------------------------------------------------------------
def _seed_without_tracker(rank: int, world_size: int) -> str:
    from megatron.core import tensor_parallel

    _init_megatron_groups()
    cpu_layer.apply_cpu_layer(skip=["cpu_rng_tracker"])
    return _raises(lambda: tensor_parallel.model_parallel_cuda_manual_seed(3))


def test_rng_tracker_fails_without_patch():
    error = run_ranks(_seed_without_tracker, 1, timeout_s=120)[0]
    assert "not compiled with CUDA" in error  # torch.cuda.get_rng_state in CudaRNGStatesTracker.add


def _rng_streams(rank: int, world_size: int, seed: int) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name

    from hybridrl.parallel.state import initialize_model_parallel

    ctx = initialize_model_parallel(tp=2, pp=2, seed=seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_1 = torch.rand(3)
    with tracker.fork():
        mp_1 = torch.rand(3)
        with tracker.fork(get_data_parallel_rng_tracker_name()):
            nested = torch.rand(3)
        mp_2 = torch.rand(3)  # the model-parallel stream resumes after the nested fork
    default_2 = torch.rand(3)
    with tracker.fork():
        mp_3 = torch.rand(3)  # and continues where the first fork left it

    # GPU-style (use_cpu_initialization=False) weight init draws from the model-parallel stream.
    weight = _column_linear(use_cpu_initialization=False).weight.detach().clone()

    # Activation recomputation saves and restores RNG state through the patched helpers: dropout
    # inside a forked region must be replayed identically in the backward recompute.
    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(x * 2.0, p=0.5, training=True)

    x = torch.ones(64, requires_grad=True)
    y = tensor_parallel.checkpoint(block, False, x)
    y.sum().backward()
    recompute_consistent = torch.equal(x.grad, (y.detach() != 0).float() * 4.0)
    return dict(tp_rank=ctx.tp_rank, dp_rank=ctx.dp_rank, pp_rank=ctx.pp_rank,
                default=torch.cat([default_1, default_2]), mp=torch.cat([mp_1, mp_2, mp_3]),
                nested=nested, weight=weight,
                recompute_consistent=recompute_consistent, tracker=type(tracker).__name__)


def test_rng_tracker_streams_follow_megatron_scheme():
    seed = 11
    outs = run_ranks(_rng_streams, 8, seed, timeout_s=120)  # TP2 x DP2 x PP2
    by_pos = {(o["tp_rank"], o["dp_rank"], o["pp_rank"]): o for o in outs}
    assert len(by_pos) == 8
    assert all(o["tracker"] == "CpuRNGStatesTracker" for o in outs)

    def draws(n: int, s: int) -> torch.Tensor:
        return torch.rand(n, generator=torch.Generator().manual_seed(s))

    for o in outs:
        stage = seed + 100 * o["pp_rank"]  # Megatron-LM's per-stage seed
        # default stream: the stage seed on every TP/DP rank, untouched by forks.
        assert torch.equal(o["default"], draws(6, stage))
        # model-parallel stream: stage seed + 2718 + tp_rank (megatron's offset), continuous
        # across forks; data-parallel stream: the stage seed.
        assert torch.equal(o["mp"], draws(9, stage + 2718 + o["tp_rank"]))
        assert torch.equal(o["nested"], draws(3, stage))
        assert o["recompute_consistent"]
    # GPU-style init: TP shards and pipeline stages differ; DP replicas are identical.
    for pp_rank in (0, 1):
        assert not torch.equal(by_pos[(0, 0, pp_rank)]["weight"], by_pos[(1, 0, pp_rank)]["weight"])
        for tp_rank in (0, 1):
            replicas = [by_pos[(tp_rank, dp_rank, pp_rank)]["weight"] for dp_rank in (0, 1)]
            assert torch.equal(*replicas)
    assert not torch.equal(by_pos[(0, 0, 0)]["weight"], by_pos[(0, 0, 1)]["weight"])


# ------------------------------------------------------------------------------------------------
# cuda_type_names
# ------------------------------------------------------------------------------------------------
def _clip_and_optimizer(rank: int, world_size: int, skip: list[str]) -> dict:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from hybridrl.parallel.state import initialize_model_parallel
    from tests.support import megatron_helpers as H

    # initialize_model_parallel applies the whole layer first; re-create the state under test.
    initialize_model_parallel(seed=1)
    if skip:
        cpu_layer.remove_cpu_layer()
        cpu_layer.apply_cpu_layer(skip=skip)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1)

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 5.0)  # norm 10

    def clip() -> None:
        from megatron.core.optimizer import clip_grads

        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)

    out = {"clip": _raises(clip), "grad": p.grad.clone()}
    # The module-level name megatron's optimizer calls must be patched too.
    from megatron.core.optimizer import optimizer as moptimizer

    out["optimizer_global_patched"] = (
        moptimizer.clip_grad_by_total_norm_fp32 is not clip_grad_by_total_norm_fp32
    )
    out["dist_opt"] = _raises(
        lambda: H.wrap_ddp_and_optimizer(H.tiny_gpt(num_layers=1), distributed_optimizer=True)
    )
    out["type_outside"] = torch.zeros(1).type()
    with cpu_layer.CudaTypeNamesMode():
        out["type_inside"] = [torch.zeros(1, dtype=d).type() for d in (torch.float32, torch.bfloat16,
                                                                          torch.float16, torch.int64)]
    return out


def test_cuda_type_names_patch_without():
    out = run_ranks(_clip_and_optimizer, 1, ["cuda_type_names"], timeout_s=120)[0]
    assert out["clip"].startswith("AssertionError")  # grad.type() == 'torch.cuda.FloatTensor'
    assert torch.equal(out["grad"], torch.full((4,), 5.0))
    assert out["dist_opt"].startswith("TypeError") and "torch.cuda.FloatTensor" in out["dist_opt"]


def test_cuda_type_names_patch_with():
    out = run_ranks(_clip_and_optimizer, 1, [], timeout_s=120)[0]
    assert out["clip"] == "" and out["dist_opt"] == ""
    assert torch.allclose(out["grad"], torch.full((4,), 0.5), atol=1e-6)  # clipped 10 -> 1
    assert out["optimizer_global_patched"]
    # The CUDA names are reported only inside the wrapped megatron functions.
    assert out["type_outside"] == "torch.FloatTensor"
    assert out["type_inside"] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor",
                                  "torch.cuda.HalfTensor", "torch.LongTensor"]


# ------------------------------------------------------------------------------------------------
# config flags that must be off on CPU
# ------------------------------------------------------------------------------------------------
def test_check_config_for_cpu_lists_every_bad_flag():
    good = SimpleNamespace(**cpu_layer.CPU_CONFIG_OVERRIDES)
    cpu_layer.check_config_for_cpu(good)
    bad = SimpleNamespace(**{**cpu_layer.CPU_CONFIG_OVERRIDES, "batch_p2p_sync": True,
                             "gradient_accumulation_fusion": True})
    with pytest.raises(ValueError, match="batch_p2p_sync=True.*gradient_accumulation_fusion=True"):
        cpu_layer.check_config_for_cpu(bad)


# ------------------------------------------------------------------------------------------------
# moe_alltoall_streams
# ------------------------------------------------------------------------------------------------
def _moe_build(rank: int, world_size: int, hf_dir: str, skip: list[str]) -> dict:
    from hybridrl.models.bridge import build_gpt_models, load_weights
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ep=world_size, seed=1)
    try:
        cpu_layer.remove_cpu_layer()
        cpu_layer.apply_cpu_layer(skip=skip)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1)
        models: list = []
        out = {"build": _raises(lambda: models.extend(build_gpt_models(hf_dir)))}
        if models:
            load_weights(models, hf_dir)
            tokens = torch.arange(8, device="cuda").unsqueeze(0)  # where the trainer's batches go
            with torch.no_grad():
                out["logits"] = models[0](tokens, tokens.clone(), None).cpu()
        return out
    finally:
        cpu_layer.apply_cpu_layer()
        destroy_model_parallel()


def test_moe_alltoall_streams_patch(tmp_path):
    from tests.support.models_fixtures import make_hf_model

    hf_dir = str(make_hf_model(tmp_path / "moe", "mixtral", seed=1))
    without = run_ranks(_moe_build, 2, hf_dir, ["moe_alltoall_streams"], timeout_s=200)
    # megatron's alltoall dispatcher makes a CUDA stream in __init__
    assert all("torch.cuda.Stream requires CUDA" in out["build"] for out in without), without
    with_patch = run_ranks(_moe_build, 2, hf_dir, [], timeout_s=200)
    assert all(out["build"] == "" for out in with_patch)
    # EP2 over gloo's all_to_all: both ranks computed the same logits from the same tokens
    assert torch.equal(with_patch[0]["logits"], with_patch[1]["logits"])


# ------------------------------------------------------------------------------------------------
# uneven_gather_scatter
# ------------------------------------------------------------------------------------------------
SPLITS = [3, 5]  # rows rank 0 and rank 1 bring (the MoE dispatcher's tokens per expert-TP rank)


def _uneven(rank: int, world_size: int, skip: list[str]) -> dict:
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    _init_megatron_groups(tp=world_size)
    try:
        cpu_layer.remove_cpu_layer()
        cpu_layer.apply_cpu_layer(skip=skip)
        group = mps.get_tensor_model_parallel_group()
        mine = torch.full((SPLITS[rank], 4), float(rank + 1), requires_grad=True, device="cuda")
        out: dict = {}
        try:
            gathered = gather_from_sequence_parallel_region(mine, group=group, output_split_sizes=SPLITS)
            # backward: megatron's reduce-scatter with the same split sizes
            rows = torch.arange(sum(SPLITS), dtype=torch.float32, device="cuda").unsqueeze(1)
            (gathered * rows * (rank + 1)).sum().backward()
            out["gathered"], out["grad"] = gathered.detach().cpu(), mine.grad.cpu()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        cpu_layer.apply_cpu_layer()
        mps.destroy_model_parallel()


def test_uneven_gather_scatter_patch():
    """megatron's gather / reduce-scatter with per-rank split sizes (the MoE alltoall dispatcher over an
    expert TP group whose ranks route different tokens): gloo refuses unequal parts; with the patch the
    gather is the ranks' rows in order and its backward (the reduce-scatter) each rank's rows of the
    summed gradient, as plain torch computes them here."""
    without = run_ranks(_uneven, 2, ["uneven_gather_scatter"], timeout_s=200)
    assert all("invalid tensor size" in out.get("error", "") for out in without), without
    results = run_ranks(_uneven, 2, [], timeout_s=200)
    expected = torch.cat([torch.full((n, 4), float(r + 1)) for r, n in enumerate(SPLITS)])
    # d/d(gathered) summed over ranks: arange(8) * (1 + 2); rank r keeps its own rows of it
    grad = (torch.arange(sum(SPLITS), dtype=torch.float32).unsqueeze(1) * 3).expand(-1, 4)
    starts = [0, SPLITS[0]]
    for rank, out in enumerate(results):
        assert "error" not in out, out
        assert torch.equal(out["gathered"], expected)
        assert torch.equal(out["grad"], grad[starts[rank]: starts[rank] + SPLITS[rank]])
