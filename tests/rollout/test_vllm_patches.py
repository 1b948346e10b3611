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


def test_each_handled_warning_is_vllms_own_and_only_it_is_dropped():
    """Patch 7: every message start in HANDLED_WARNINGS is a warning vLLM's module of that logger logs (a vLLM that
    rewords one fails here, not silently); those records are dropped and every other record of the logger is kept."""
    import ast
    import importlib

    vllm_patches.quiet_handled_logs()
    for name, handled in vllm_patches.HANDLED_WARNINGS.items():
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        logger = logging.getLogger(name)
        kept = _Kept()
        logger.addHandler(kept)
        previous = logger.level
        logger.setLevel(logging.DEBUG)  # the filter decides here, not the level
        try:
            for start, why in handled:
                assert any(text.startswith(start) for text in texts), (name, start)
                assert why, (name, start)
                logger.warning(start + " (as vLLM words it)")  # dropped
                logger.error(start)  # an error is never dropped
            logger.warning("a warning hybridrl does not handle")
        finally:
            logger.removeHandler(kept)
            logger.setLevel(previous)
        assert [(r.levelname, r.getMessage()) for r in kept.records] == [
            *(("ERROR", start) for start, _ in handled), ("WARNING", "a warning hybridrl does not handle")]


def _level_after_quieting(env: dict[str, str]) -> str:
    """VLLM_LOGGING_LEVEL in a fresh process after patch 7 (vLLM configures its loggers from it when an engine is
    built; the e2e runs check that no INFO line reaches the console)."""
    import os
    import subprocess
    import sys

    code = ("import os; from hybridrl.rollout import vllm_patches; vllm_patches.quiet_handled_logs(); "
            "print(os.environ['VLLM_LOGGING_LEVEL'])")
    clean = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_vllms_info_lines_are_off_unless_the_user_chose_a_level():
    assert _level_after_quieting({}) == "WARNING"
    assert _level_after_quieting({"VLLM_LOGGING_LEVEL": "DEBUG"}) == "DEBUG"
