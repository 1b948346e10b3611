"""User reward functions loaded from a Python file (``algorithm.custom_reward_function.path/name``).

The file is imported and run as ordinary Python: it is TRUSTED CODE with the trainer's full
permissions. Only point the config at files you wrote or reviewed.

Two call conventions are accepted, told apart by the function's parameter names:

* hybridrl's: ``fn(response, ground_truth, extra)`` (``extra`` holds data_source, extra_info, ...);
* verl's: ``fn(data_source, solution_str, ground_truth, extra_info)`` (any function with a
  ``solution_str`` parameter), so verl reward files work unchanged.

The function may return a number, a `ScoreResult`, or a dict with ``score`` (and optionally ``acc``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridrl.rewards.registry import ScoreResult
from hybridrl.user_code import import_user_file


class RewardFunctionError(RuntimeError):
    """A user reward function that cannot be loaded, raised, or returned something that is not a score."""


def load_reward_function(path: str | Path, name: str = "compute_score") -> Callable[..., Any]:
    """The function `name` defined in the Python file `path` (trusted code: it is executed)."""
    module = import_user_file(path, what="custom reward file", prefix="hybridrl_custom_reward_",
                              error=RewardFunctionError)
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and inspect.isfunction(v)
        )
        raise RewardFunctionError(
            f"custom reward file {str(path)!r} has no function {name!r}; functions defined there: {defined}"
        )
    if not callable(function):
        raise RewardFunctionError(f"{name!r} in {str(path)!r} is a {type(function).__name__}, not a function")
    return function


def signature_problem(function: Callable[..., Any]) -> str | None:
    """Why `adapt_reward_function(function)` could not call `function`, or None when it can: the
    arguments the call would pass are bound to its signature, without calling it."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: only a call can tell
    parameters = set(signature.parameters)
    if "solution_str" in parameters:
        kwargs = {"solution_str": "", "ground_truth": None}
        kwargs.update({name: None for name in ("data_source", "extra_info") if name in parameters})
        call, form = (lambda: signature.bind(**kwargs)), f"verl's convention, called as fn({', '.join(kwargs)})"
    else:
        call, form = (lambda: signature.bind("", None, {})), "called as fn(response, ground_truth, extra)"
    try:
        call()
    except TypeError as error:
        return (f"cannot take the reward call ({form}): {error}; define fn(response, ground_truth, extra) or "
                "verl's fn(data_source, solution_str, ground_truth, extra_info)")
    return None


def adapt_reward_function(function: Callable[..., Any]) -> Callable[[str, Any, Mapping[str, Any]], ScoreResult]:
    """Wrap a user function into the scorer signature (see the module docstring).

    Return values are converted by the `RewardManager`, which also reports errors with the sample
    index; this wrapper only maps the arguments.
    """
    try:
        parameters = set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # builtins without a signature: use our convention
        parameters = set()

    if "solution_str" in parameters:

        def verl_style(response: str, ground_truth: Any, extra: Mapping[str, Any]) -> Any:
            kwargs: dict[str, Any] = {"solution_str": response, "ground_truth": ground_truth}
            if "data_source" in parameters:
                kwargs["data_source"] = extra.get("data_source")
            if "extra_info" in parameters:
                kwargs["extra_info"] = extra.get("extra_info")
            return function(**kwargs)

        verl_style.__name__ = getattr(function, "__name__", "custom_reward")
        return verl_style
    return function
