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
    assert D.backend_for("cuda") == "nccl"
    assert D.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="resolved device"):
        D.backend_for("auto")


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
