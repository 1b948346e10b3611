"""Routing replay: force megatron's MoE routers to pick given experts (issue 20, `router_replay`).

megatron-core 0.16 builds a `RouterReplay` object into every `TopKRouter` when the TransformerConfig
has `moe_enable_routing_replay=True`; its action decides the top-k step of the router:
RECORD keeps the router's own choice, REPLAY_FORWARD uses the indices set on it (the routing
weights are then the router's scores gathered at those indices, so gradients still reach the router).
megatron keeps one global list of those objects for every model built in the process (actor and
reference alike); the helpers here drive the routers of the given model chunks only, so replaying
the actor's routing never touches another model's.

Token order. A router sees the hidden states of a micro-batch as [seq, batch, hidden] flattened
to [seq * batch] (seq-major); routing kept per row as [rows, seq, moe_layers, top_k] is transposed
into that order by `to_router_order` (padded micro-batches; packed ones are one row already).
Under sequence parallelism each TP rank routes only its sequence chunk, so a replay would need the
chunk sliced out: refused here (`replaying` checks the token count) rather than guessed.

The rollout's column (`routed_experts`, `hybridrl.rollout.engine.routed_experts_column`) holds -1
where vLLM routed nothing (padding; a response's last token, never fed to vLLM). Those positions
are replayed to experts 0..k-1 (`chunk_routing`): a padded position is never read by a real token
(causal attention on left-aligned rows, its own segment when packed) and the last token's output
predicts nothing, so their routing changes no log-prob.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def moe_routers(models: Sequence[Any], *, required: bool = True) -> list[tuple[int, Any]]:
    """(global layer number, 1-based; the layer's `TopKRouter`) of every MoE router in these model
    chunks, in layer order. Raises if the models were built without `moe_enable_routing_replay`, and
    (with `required`) if they hold no router."""
    from megatron.core.transformer.moe.router import TopKRouter

    found: list[tuple[int, Any]] = []
    for model in models:
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ValueError("the MoE routers have no RouterReplay: build the model with "
                                     "moe_enable_routing_replay=True (config override) to record or replay routing")
                found.append((module.layer_number, module))
    if not found and required:
        raise ValueError("these model chunks hold no MoE router: routing replay needs a mixture-of-experts model")
    return sorted(found, key=lambda item: item[0])


def to_router_order(routed: torch.Tensor) -> list[torch.Tensor]:
    """[rows, seq, moe_layers, top_k] expert ids -> per MoE layer, [seq * rows, top_k] int64 in the
    token order megatron's router sees a padded micro-batch of those rows."""
    if routed.dim() != 4:
        raise ValueError(f"routed experts must be [rows, seq, moe_layers, top_k], got shape {tuple(routed.shape)}")
    rows, seq, layers, top_k = routed.shape
    ordered = routed.permute(2, 1, 0, 3).reshape(layers, seq * rows, top_k).long()
    return list(ordered.unbind(0))


def from_router_order(per_layer: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """Inverse of `to_router_order`: per-layer [seq * rows, top_k] -> [rows, seq, moe_layers, top_k]."""
    stacked = torch.stack(list(per_layer))  # [layers, seq * rows, k]
    layers, tokens, top_k = stacked.shape
    if tokens % rows:
        raise ValueError(f"{tokens} routed tokens do not split into {rows} rows")
    return stacked.reshape(layers, tokens // rows, rows, top_k).permute(2, 1, 0, 3).contiguous()


def chunk_routing(routed: torch.Tensor, layer_numbers: Sequence[int],
                  moe_layers: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The replay of one model chunk from a micro-batch's aligned column `routed` [b, s, moe_layers, k]
    (layer axis: the model's MoE layers `moe_layers`, 0-based, in order): per router of the chunk
    (`layer_numbers`: megatron's 1-based global numbers, as `moe_routers` lists them) [s * b, k] int64
    in router order, and which of those tokens vLLM routed (bool [s * b])."""
    index = {layer: i for i, layer in enumerate(moe_layers)}
    missing = [n for n in layer_numbers if n - 1 not in index]
    if missing:
        raise ValueError(f"MoE layers {[n - 1 for n in missing]} of this chunk are not in the routed "
                         f"experts' layers {list(moe_layers)}")
    picked = routed[:, :, [index[n - 1] for n in layer_numbers]].long()
    routed_by_vllm = picked >= 0  # [b, s, L, k]
    top_k = picked.shape[-1]
    fill = torch.arange(top_k, device=picked.device).expand_as(picked)
    per_layer = to_router_order(torch.where(routed_by_vllm, picked, fill))
    valid = list(routed_by_vllm.all(-1).permute(2, 1, 0).reshape(len(layer_numbers), -1).unbind(0))
    return per_layer, valid


@dataclass
class ReplayMismatch:
    """Counts, over the tokens vLLM routed, how often megatron's own top-k (computed alongside the
    replay from the same scores) is a different expert set: the routing mismatch replay removes."""

    tokens: int = 0
    differing: int = 0

    def add(self, own: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor) -> None:
        differs = (own.sort(-1).values != replayed.sort(-1).values).any(-1) & valid
        self.tokens += int(valid.sum())
        self.differing += int(differs.sum())

    @property
    def fraction(self) -> float:
        return self.differing / self.tokens if self.tokens else 0.0


@contextmanager
def recording(models: Sequence[Any]) -> Iterator[list[torch.Tensor]]:
    """Record the routers' own top-k choice during the block; the yielded list is filled, per MoE
    layer of these chunks in layer order, with [tokens, top_k] of the block's last forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [router.router_replay for _, router in moe_routers(models)]
    out: list[torch.Tensor] = []
    for replay in routers:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        for replay in routers:
            if replay.get_recorded_indices() is None:
                raise RuntimeError("a router recorded nothing: no forward ran inside recording()")
            out.append(replay.get_recorded_indices().detach().clone())
    finally:
        for replay in routers:
            replay.clear_router_replay_action()
            replay.clear_indices()


@contextmanager
def replaying(models: Sequence[Any], per_layer: Sequence[torch.Tensor], *,
              mismatch: ReplayMismatch | None = None, valid: Sequence[torch.Tensor] | None = None) -> Iterator[None]:
    """Every forward inside the block routes each token of MoE layer i of these chunks to
    `per_layer[i]` ([tokens, top_k] in router order, see `to_router_order`); the backward of such a
    forward needs no routing (without activation recompute). With `mismatch`, megatron's own top-k of
    each router call is also computed and compared with the replayed one over the tokens `valid[i]`
    marks (all when None)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(models)
    if len(per_layer) != len(routers):
        raise ValueError(f"routing for {len(per_layer)} MoE layers given, these model chunks hold "
                         f"{len(routers)} (layers {[n for n, _ in routers]})")
    hooks = []
    for i, ((number, router), indices) in enumerate(zip(routers, per_layer)):
        replay = router.router_replay
        replay.clear_indices()
        replay.target_topk_idx = indices
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        hooks.append(router.register_forward_pre_hook(_token_count_check(number, indices.shape[0])))
        if mismatch is not None:
            mask = valid[i] if valid is not None else torch.ones(indices.shape[0], dtype=torch.bool)
            replay.get_replay_topk = _comparing(replay, mismatch, mask)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for _, router in routers:
            router.router_replay.__dict__.pop("get_replay_topk", None)
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


def _comparing(replay: Any, mismatch: ReplayMismatch, valid: torch.Tensor) -> Any:
    # An instance attribute over RouterReplay.get_replay_topk: the replayed result is megatron's own;
    # the extra top-k is the choice megatron would have made from the same scores.
    method = type(replay).get_replay_topk

    def get_replay_topk(scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                        default_compute_topk: Any = None) -> Any:
        probs, indices = method(replay, scores, topk, num_groups, group_topk, default_compute_topk)
        with torch.no_grad():
            _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        mismatch.add(own, indices, valid.to(own.device))
        return probs, indices
    return get_replay_topk


def _token_count_check(layer: int, expected: int) -> Any:
    # megatron's replay gathers the scores at the given rows without checking their count: fewer
    # rows than tokens would route a prefix and fail later, more would be cut silently.
    def check(module: Any, args: tuple) -> None:
        hidden = args[0]
        tokens = hidden.shape[0] * hidden.shape[1] if hidden.dim() == 3 else hidden.shape[0]
        if tokens != expected:
            raise ValueError(f"layer {layer}: routing replay holds {expected} tokens, the router sees {tokens} "
                             "(a different micro-batch, or a sequence-parallel chunk)")
    return check
