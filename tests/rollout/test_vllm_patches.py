"""vllm_patches.quiet_tokenizerless_warmup: vLLM's start-up warning for an engine without a tokenizer is dropped, and
nothing else is."""
from __future__ import annotations

import inspect
import logging

from hybridrl.rollout import vllm_patches


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _warn(logger: logging.Logger, message: str, error: Exception) -> None:
    try:
        raise error
    except Exception:
        logger.warning(message, exc_info=True)  # as vLLM's Renderer.warmup logs it


def test_only_the_tokenizerless_warmup_warning_is_dropped_while_an_engine_is_built():
    import vllm.renderers.base as renderer

    # the record and the error are vLLM's own: its warmup logs that message, its get_tokenizer raises that error
    source = inspect.getsource(renderer)
    message, error_text = vllm_patches.TOKENIZERLESS_WARMUP
    assert f'logger.warning("{message}", exc_info=True)' in source and error_text in source
    logger = logging.getLogger(renderer.__name__)
    kept = _Kept()
    logger.addHandler(kept)
    try:
        with vllm_patches.quiet_tokenizerless_warmup():
            _warn(logger, message, ValueError(error_text))  # dropped
            _warn(logger, message, ValueError("a template that does not render"))  # another failure: kept
            _warn(logger, "something else", ValueError(error_text))  # kept
        _warn(logger, message, ValueError(error_text))  # outside an engine's build: kept
    finally:
        logger.removeHandler(kept)
    assert [(r.getMessage(), str(r.exc_info[1])) for r in kept.records] == [
        (message, "a template that does not render"), ("something else", error_text), (message, error_text)]
