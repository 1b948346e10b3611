"""Expert capacity lifted for a forward: while `without_capacity` is active every MoE layer of a model
routes dropless, as vLLM does.

The weight sync's probe (`MegatronActor.compute_log_prob(free_routing=True)`) compares megatron's
log-probs with vLLM's, and vLLM has no expert capacity: with `moe_expert_capacity_factor` set,
megatron would drop tokens that vLLM keeps, and the gap would measure the capacity instead of the
weights. megatron-core 0.16.1 reads the capacity from the layers' shared `TransformerConfig` at
every routing (`TopKRouter.routing`: `apply_router_token_dropping`), except the alltoall
dispatcher's drop-and-pad mode, which it fixes when the dispatcher is built
(`MoEAlltoAllTokenDispatcher.drop_and_pad`); both are switched off, and restored on exit.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def without_capacity(chunks: Sequence[Any], config: Any) -> Iterator[None]:
    """Route every token of `chunks` (built from `config`) to its top-k experts, none dropped or padded."""
    if getattr(config, "moe_expert_capacity_factor", None) is None:
        yield
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    dispatchers = [m.token_dispatcher for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    padded = [d for d in dispatchers if getattr(d, "drop_and_pad", False)]
    saved = (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity)
    config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity = None, False
    for dispatcher in padded:
        dispatcher.drop_and_pad = False
    try:
        yield
    finally:
        config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity = saved
        for dispatcher in padded:
            dispatcher.drop_and_pad = True
