"""The scorer registry: rule-based reward functions under names that configs refer to.

A scorer has one signature::

    scorer(response: str, ground_truth: Any, extra: Mapping[str, Any], **options) -> ScoreResult

``response`` is the decoded response text (special tokens removed), ``ground_truth`` the row's ground
truth (see `hybridrl.data.dataset`), ``extra`` the row's other metadata (``data_source``,
``extra_info``, ``reward_spec``, ``prompt``, ``index``). ``options`` are keyword-only settings fixed
when the scorer is looked up (``get_scorer("gsm8k", mode="flexible")``).

``score`` is the reward; ``acc`` says whether the answer was right (None when the scorer has no
notion of right, e.g. a pure format check counts as right when the format is met).
"""
from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ScoreResult:
    score: float
    acc: bool | None = None
    # Why, for logs and tests: the extracted answer, the failure reason, ...
    details: Mapping[str, Any] = field(default_factory=dict)


class Scorer(Protocol):
    def __call__(self, response: str, ground_truth: Any, extra: Mapping[str, Any]) -> ScoreResult: ...


class UnknownScorerError(KeyError):
    """A scorer name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


_SCORERS: dict[str, Callable[..., ScoreResult]] = {}
_ALIASES: dict[str, str] = {}
# Modules whose import registers the built-in scorers (imported on first lookup, so importing the
# registry stays cheap and free of cycles).
_BUILTIN_MODULES = (
    "hybridrl.rewards.gsm8k",
    "hybridrl.rewards.math_answer",
    "hybridrl.rewards.format_check",
    "hybridrl.rewards.countdown",
    "hybridrl.data.demo_task",
    "hybridrl.data.arith_task",
    "hybridrl.data.secret_task",
)
_builtins_loaded = False


def register_scorer(name: str, *aliases: str) -> Callable[[Callable[..., ScoreResult]], Callable[..., ScoreResult]]:
    """Decorator: register `fn` under `name` (and `aliases`, e.g. a data_source like 'openai/gsm8k')."""

    def decorate(fn: Callable[..., ScoreResult]) -> Callable[..., ScoreResult]:
        for key in (name, *aliases):
            owner = _SCORERS.get(key) or _SCORERS.get(_ALIASES.get(key, ""))
            if owner is not None and owner is not fn:
                raise ValueError(f"scorer name {key!r} is already registered to {owner.__qualname__}")
        _SCORERS[name] = fn
        for alias in aliases:
            _ALIASES[alias] = name
        return fn

    return decorate


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def available_scorers() -> list[str]:
    """Registered scorer names (aliases not included)."""
    _load_builtins()
    return sorted(_SCORERS)


def known_scorer_names() -> list[str]:
    """Every name a config or a row's data_source may use for a scorer: the names and their aliases, sorted."""
    _load_builtins()
    return sorted([*_SCORERS, *_ALIASES])


def scorer_aliases() -> dict[str, str]:
    _load_builtins()
    return dict(_ALIASES)


AUTO = "auto"  # algorithm.reward_fn: each row's scorer by its data_source (verl's default_compute_score)


def scorer_for_data_source(data_source: str) -> str | None:
    """The registered scorer a row's `data_source` names (its name or an alias: openai/gsm8k -> gsm8k), or None."""
    _load_builtins()
    name = _ALIASES.get(data_source, data_source)
    return name if name in _SCORERS else None


def by_data_source(response: str, ground_truth: Any, extra: Mapping[str, Any]) -> ScoreResult:
    """`algorithm.reward_fn: auto`: the row is scored by the scorer its `data_source` names, so one job mixes
    GSM8K and MATH files as verl's default reward does."""
    source = str(extra.get("data_source"))
    name = scorer_for_data_source(source)
    if name is None:
        raise UnknownScorerError(
            f"no scorer for data_source {source!r} (algorithm.reward_fn=auto picks each row's by it); known: "
            f"{', '.join(known_scorer_names())}; name one with algorithm.reward_fn")
    return _SCORERS[name](response, ground_truth, extra)


def get_scorer(name: str, **options: Any) -> Callable[[str, Any, Mapping[str, Any]], ScoreResult]:
    """The scorer registered as `name` (or an alias), with keyword `options` bound.

    Unknown names and options fail here, at start-up, not at the first reward computation.
    """
    _load_builtins()
    if name == AUTO and not options:
        return by_data_source
    canonical = _ALIASES.get(name, name)
    if canonical not in _SCORERS:
        known = sorted([*_SCORERS, *_ALIASES])
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownScorerError(
            f"unknown reward scorer {name!r}.{hint} Valid names: {', '.join(sorted(_SCORERS))}"
            + (f" (aliases: {', '.join(sorted(_ALIASES))})" if _ALIASES else "")
        )
    fn = _SCORERS[canonical]
    if not options:
        return fn
    accepted = {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"scorer {canonical!r} has no option(s) {unknown}; its options: {sorted(accepted) or 'none'}"
        )
    return functools.partial(fn, **options)
