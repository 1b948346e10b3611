"""fp32 matmuls through oneDNN on CPU: taken only where the probe shows fp32 arithmetic, and then
the results are fp32 results (against MKL's and float64), in megatron's training forms too."""
import torch

from hybridrl.parallel.cpu.matmul import all_exact, onednn_fp32_is_exact, probe_products
from tests.support.forked import run_ranks


def test_probe_catches_bf16_arithmetic():
    assert all_exact(probe_products())                        # fp32 inputs, default (MKL) route
    assert not all_exact(probe_products(torch.bfloat16))      # what bf16 math would give
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the probe leaves the setting alone


def _route_in_worker(rank: int, world: int) -> dict:
    from hybridrl.parallel import state

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(700, 512, generator=gen, requires_grad=True)
    w = torch.randn(1536, 512, generator=gen, requires_grad=True)
    g = torch.randn(700, 1536, generator=gen)

    def linear_grads():
        x.grad = w.grad = None
        y = torch.nn.functional.linear(x, w)
        y.backward(g)
        return y.detach().clone(), x.grad.clone(), w.grad.clone()

    before = linear_grads()
    exact = onednn_fp32_is_exact()
    state.initialize_model_parallel(tp=1, pp=1, device="cpu")  # what every megatron worker on CPU runs
    routed = torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    after = linear_grads()
    reference = torch.nn.functional.linear(x.double(), w.double())
    return {
        "exact": exact, "routed": routed,
        "rel_diff": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(after, before)),
        "err_vs_fp64": float((after[0].double() - reference).abs().max() / reference.abs().max()),
    }


def test_workers_route_fp32_matmuls_only_when_exact_and_stay_fp32():
    out = run_ranks(_route_in_worker, 1, timeout_s=120)[0]
    assert out["routed"] == out["exact"]
    # fp32 results either way: ~1e-6 apart (summation order over 512-700 terms), far from bf16 (~4e-3)
    assert out["rel_diff"] < 1e-5 and out["err_vs_fp64"] < 1e-5, out
