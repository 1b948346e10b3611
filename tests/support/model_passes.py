"""Megatron passes run inside forked ranks by the model tests: full-vocabulary logits through megatron's own
forward-only schedule, and the gradients of a weighted sum of the logits saved as a checkpoint (so the layout math
maps them back to HF names). Shared by tests/models/test_logits.py, tests/models/test_moe.py and
tests/models/test_real.py."""
from __future__ import annotations

from typing import Any

import torch

from tests.support.models_fixtures import VOCAB, sample_tokens

# the tokens `grads_rank` differentiates at (the logits tests' sample)
GRAD_TOKENS = sample_tokens(batch=2)


def pipeline_logits(models: list[Any], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits from megatron's forward-only schedule; None except on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridrl.parallel.state import get_context

    batch, seq = tokens.shape
    micro = [tokens[i:i + 1] for i in range(batch)]

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        positions = torch.arange(seq).unsqueeze(0).expand_as(ids)
        output = model(ids, positions, None)

        def collect(output_tensor, non_loss_data=False):
            return gather_from_tensor_model_parallel_region(output_tensor)

        return output, collect

    for model in models:
        model.eval()
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in models] if len(models) > 1 else iter(micro),
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return torch.cat(store, dim=0) if get_context().is_last_pp_stage else None


def grads_rank(rank: int, world_size: int, hf_dir: str, weights: torch.Tensor, out: str) -> None:
    """Backward of sum(logits * weights) at TP=world_size; grads saved as a checkpoint (in place of the
    weights) so the layout math maps them back to HF names."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridrl.models.bridge import build_gpt_model, load_weights, save_mcore_checkpoint
    from hybridrl.parallel.state import destroy_model_parallel, initialize_model_parallel

    ctx = initialize_model_parallel(tp=world_size, device="cpu")
    try:
        model = build_gpt_model(hf_dir)
        load_weights([model], hf_dir)
        logits = gather_from_tensor_model_parallel_region(
            model(GRAD_TOKENS, torch.arange(GRAD_TOKENS.shape[1]).expand_as(GRAD_TOKENS), None))
        (logits[..., :VOCAB] * weights).sum().backward()
        with torch.no_grad():
            for name, param in model.named_parameters():
                # Each TP rank normalizes only its own heads: megatron's finalize_model_grads sums the
                # q/k norm gradients over TP (the trainer's DDP path); do the same here.
                if "q_layernorm" in name or "k_layernorm" in name:
                    torch.distributed.all_reduce(param.grad, group=ctx.tp_group)
                param.copy_(param.grad)
        save_mcore_checkpoint([model], out)
    finally:
        destroy_model_parallel()
