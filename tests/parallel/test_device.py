"""Device selection logic, GPU branches included, tested on CPU (the probes are injectable)."""
import pytest
import torch

from hybridrl.parallel import device as D


def test_resolve_auto_follows_cuda_availability():
    assert D.resolve_device("auto", cuda_is_available=True) == "cuda"
    assert D.resolve_device("auto", cuda_is_available=False) == "cpu"
    assert D.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_resolve_explicit_devices():
    assert D.resolve_device("cpu", cuda_is_available=True) == "cpu"
    assert D.resolve_device("CUDA", cuda_is_available=True) == "cuda"
    assert D.resolve_device("cuda:1", cuda_is_available=True) == "cuda"


def test_resolve_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available.*device='cpu'"):
        D.resolve_device("cuda", cuda_is_available=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the real probe on a CPU-only machine")
def test_resolve_cuda_with_real_probe_on_cpu_machine():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        D.resolve_device("cuda")


def test_resolve_unknown_device():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        D.resolve_device("tpu", cuda_is_available=False)


def test_backend_for():
    assert D.dist_backend_for("cuda") == "nccl"
    assert D.dist_backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="resolved device"):
        D.dist_backend_for("auto")


def test_default_dtype_for():
    assert D.default_dtype_for("cuda") is torch.bfloat16
    assert D.default_dtype_for("cpu") is torch.float32
    assert D.default_dtype_for("cpu", "bf16") is torch.bfloat16
    assert D.default_dtype_for("cuda", "fp32") is torch.float32
    assert D.default_dtype_for("cuda", "torch.float16") is torch.float16
    assert D.default_dtype_for("cpu", torch.float64) is torch.float64
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        D.default_dtype_for("cpu", "fp8")


def test_layer_spec_kind():
    assert D.layer_spec_kind("cuda", te_available=True) == "te"
    assert D.layer_spec_kind("cuda", te_available=False) == "local"
    # TE kernels are CUDA-only: CPU gets the local spec even where TE happens to be installed.
    assert D.layer_spec_kind("cpu", te_available=True) == "local"
    assert D.layer_spec_kind("cuda") == ("te" if D.te_available() else "local")
    with pytest.raises(ValueError):
        D.layer_spec_kind("auto")


def test_adapters_get_the_local_spec_and_the_plan_knows_what_it_serves():
    """A LoRA actor's model is megatron's local layer spec on GPUs with TE too (TE fuses the norm into the adapted
    linear layers); the device policy the plan reads says the same: no packed attention there (on CPU the CPU
    layer's stand-in serves it as before)."""
    from hybridrl.parallel.device_policy import DEVICE_POLICIES

    assert D.layer_spec_kind("cuda", te_available=True, adapters=True) == "local"
    assert D.layer_spec_kind("cpu", te_available=False, adapters=True) == "local"
    for name, policy in DEVICE_POLICIES.items():
        te_spec = D.layer_spec_kind(name, te_available=True) == "te"
        for adapters in (False, True):
            local_on_gpu = te_spec and D.layer_spec_kind(name, te_available=True, adapters=adapters) == "local"
            assert (policy.packed_attention_for(adapters) is None) == local_on_gpu, (name, adapters)


def test_te_available_is_a_bool_and_matches_import():
    has = D.te_available()
    assert isinstance(has, bool)
    if not has:
        with pytest.raises(ImportError):
            import transformer_engine  # noqa: F401


def test_torch_threads_share_the_node_cores_among_its_ranks():
    from hybridrl.parallel.device import torch_threads_per_rank

    assert torch_threads_per_rank(2, cores=2) == 1
    assert torch_threads_per_rank(4, cores=16) == 4
    assert torch_threads_per_rank(3, cores=16) == 5
    assert torch_threads_per_rank(8, cores=2) == 1      # never zero
    assert torch_threads_per_rank(1) == len(__import__("os").sched_getaffinity(0))
    with pytest.raises(ValueError, match="ranks_on_node"):
        torch_threads_per_rank(0)


@pytest.mark.parametrize("setting,ranks_on_node", [(None, 2), (None, 1), (3, 2)])
def test_worker_threads_follow_the_config_or_share_the_cores(setting, ranks_on_node):
    """trainer.torch_threads_per_rank pins a worker's torch threads (the benchmarks' one thread per
    process); unset, the node's cores are shared out among its ranks."""
    import torch

    from hybridrl.config import plan_from_sources
    from hybridrl.controller.base_worker import RankContext, Worker
    from hybridrl.parallel.device import torch_threads_per_rank

    plan = plan_from_sources("configs/examples/cpu_tiny_grpo.yaml", [
        "actor_rollout_ref.model.path=configs/models/tiny-demo",
        f"trainer.torch_threads_per_rank={'null' if setting is None else setting}"])
    context = RankContext(group="actor_rollout_ref", rank=0, world_size=ranks_on_node, node_rank=0, local_rank=0,
                          local_world_size=ranks_on_node, use_gpu=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)  # a stale count the worker must replace
        Worker(context).use_torch_threads(plan.config.trainer.torch_threads_per_rank)
        assert torch.get_num_threads() == (setting or torch_threads_per_rank(ranks_on_node))
    finally:
        torch.set_num_threads(before)


def test_release_cached_blocks_runs_on_both_devices():
    # On this CPU build torch.cuda.empty_cache() is a no-op, so the cuda branch runs for real here:
    # the sync calls it on every GPU step (a missing import once broke exactly this call).
    D.release_cached_blocks("cuda")
    D.release_cached_blocks("cpu")
