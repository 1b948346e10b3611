"""A role's checkpoint saved on one layout and resumed on another, rank side and parent side: one optimizer step
then save (`checkpoint_rank(..., "save")`), a resume (or a weights-only load) then the next step, its metrics, lr and
weights gathered to HF names for comparison. Shared by the checkpoint-layout and context-parallel tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.forked import run_ranks
from tests.support.models_fixtures import safetensors_state
from tests.support.training_fixtures import job_config, trained_role


def checkpoint_rank(rank: int, world: int, config: Any, batches: list[Any], ckpt: str, out: str, mode: str,
          role: str = "actor") -> Any:
    from hybridrl.models.bridge import export_hf, load_weights
    from hybridrl.training.checkpointing import load_role_checkpoint, save_role_checkpoint

    backend, update, chunks = trained_role(config, role, batches)
    if mode == "save":
        update(chunks[0])
        save_role_checkpoint(backend, ckpt)
        return None
    info = None
    if mode == "resume":
        info = load_role_checkpoint(backend, ckpt)
    else:  # weights only: what a resume without the optimizer state would do
        load_weights(backend.chunks, Path(ckpt) / "model")
    metrics = update(chunks[1])
    if role == "actor":
        export_hf(backend.chunks, out, force=True)
        weights = None
    else:  # value model: its weights as HF ranges, stitched in the parent
        weights = value_model_pieces(backend)
    return {"metrics": metrics, "lr": backend.schedule.current_lr, "weights": weights,
            "resharded": None if info is None else info["resharded"]}


def value_model_pieces(backend: Any) -> list[tuple[str, int | None, int, torch.Tensor]]:
    """(HF name, axis, start, tensor) of every HF range this rank's shards hold, plus the head."""
    from hybridrl.models.bridge import chunk_info
    from hybridrl.models.layout import chunk_tensor_plans

    out = []
    for chunk in backend.chunks:
        info = chunk_info(chunk)
        tensors = chunk.state_dict(keep_vars=True)
        for plan in chunk_tensor_plans(info.source.shape, info.layout, info.chunk, info.tp_rank):
            value = tensors[plan.name].detach().clone()
            if plan.name == "output_layer.weight":  # the value head
                out.append(("score.weight", None, 0, value))
                continue
            offset = 0
            for seg in plan.segments:
                if seg.hf_name is not None:
                    piece = value if plan.axis is None else value.narrow(plan.axis, offset, seg.length)
                    out.append((seg.hf_name, plan.axis, seg.start, piece))
                offset += seg.length
    return out


def stitch_pieces(pieces: list[tuple[str, int | None, int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole HF tensors from the ranks' pieces (replicated ones taken once, split ones concatenated)."""
    by_name: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for name, axis, start, value in pieces:
        by_name.setdefault(name, {})[start] = (axis, value)
    out = {}
    for name, parts in by_name.items():
        axis = next(iter(parts.values()))[0]
        ordered = [v for _, (_, v) in sorted(parts.items())]
        out[name] = ordered[0] if axis is None else torch.cat(ordered, dim=axis)
    return out


def run_resume(config: Any, world: int, batches: list[Any], ckpt: Path, out: Path, mode: str,
               role: str = "actor") -> Any:
    results = run_ranks(checkpoint_rank, world, config, batches, str(ckpt), str(out), mode, role)
    metrics = [r["metrics"] for r in results if r is not None and r["metrics"] is not None]
    assert metrics, "no output rank returned metrics"
    step = metrics[0].per_step[0] if role == "actor" else metrics[0]
    pieces = [p for r in results if r is not None and r["weights"] for p in r["weights"]]
    return {"metrics": metrics[0], "step": step, "lr": results[0]["lr"], "resharded": results[0]["resharded"],
            "weights": safetensors_state(out) if role == "actor" else stitch_pieces(pieces)}


def assert_same_next_step(run: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    a, b = run["metrics"], reference["metrics"]
    assert run["lr"] == reference["lr"], label
    for field in ("pg_loss", "grad_norm", "entropy", "approx_kl", "clipfrac"):
        assert abs(getattr(a, field) - getattr(b, field)) <= 1e-5, (label, field, getattr(a, field), getattr(b, field))
    assert run["weights"].keys() == reference["weights"].keys()
    gap = max(float((run["weights"][n] - w).abs().max()) for n, w in reference["weights"].items())
    assert gap <= 1e-5, (label, gap)


def resume_config(hf: Path, *, tp: int, pp: int, dp: int = 1, distributed: bool = False,
            first_stage_layers: int | None = None) -> Any:
    config = job_config(hf, world=tp * pp * dp, tp=tp, pp=pp, distributed_optimizer=distributed)
    config.actor_rollout_ref.actor.optim.lr_warmup_steps = 4
    config.actor_rollout_ref.actor.megatron.num_layers_in_first_pipeline_stage = first_stage_layers
    return config
