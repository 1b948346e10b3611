"""The reward model on megatron: one score per sequence from a sequence-classification checkpoint.

The model is the value model of `value_head` with its head loaded from the checkpoint's
`score.weight` (e.g. HF `LlamaForSequenceClassification` with `num_labels=1`). Like HF's
sequence classifiers, the score is the head's output at the last real token of the row
(prompt + response, padding excluded).

Batch columns (this DP rank's rows): the model inputs of `sequences`. Output: `rm_scores` `[B]`
float32 on the output ranks (last pipeline stage, TP rank 0), None elsewhere. Placing the score on
the last response token (token-level rewards) is the controller's reward code's job.
"""
from __future__ import annotations

import torch

from hybridrl.config.plan import Plan
from hybridrl.data.batch import Batch
from hybridrl.training.backend import MegatronBackend
from hybridrl.training.micro_batching import restore_order
from hybridrl.training.sequences import ModelInputs


def last_token_scores(micro: ModelInputs, output: torch.Tensor) -> torch.Tensor:
    """`[b, 1]` float32: the `[b, s, 1]` (packed: `[1, t, 1]`) output at each row's last real column."""
    return micro.take(output, micro.last_index.unsqueeze(1)).reshape(-1, 1).float()


class MegatronRewardModel:
    def __init__(self, backend: MegatronBackend, plan: Plan) -> None:
        if not backend.spec.value_head:
            raise ValueError("the reward model needs a value-head backend (role_spec(plan, 'reward_model'))")
        if not backend.head_loaded and backend.ctx.is_last_pp_stage:
            raise ValueError(f"{backend.spec.model_path} has no score.weight: not a sequence-classification checkpoint")
        self.backend = backend
        self.micro_batch_size = plan.forward("reward_scores").micro_batch_size

    def compute_scores(self, batch: Batch) -> Batch | None:
        backend = self.backend
        tensors = batch.tensors
        partition = backend.partition(tensors, self.micro_batch_size)
        micros = backend.micro_batches(tensors, partition)
        outputs = backend.forward_only(micros, last_token_scores)
        if not backend.is_output_rank:
            return None
        return Batch({"rm_scores": restore_order(outputs, partition).squeeze(-1).cpu()})
