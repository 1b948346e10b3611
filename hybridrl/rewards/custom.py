"""User reward functions loaded from a Python file (``algorithm.custom_reward_function.path/name``).

The file is imported and run as ordinary Python: it is TRUSTED CODE with the trainer's full
permissions. Only point the config at files you wrote or reviewed.

Each call scores one sample. The function's parameter names decide how it is called (`call_form` says it in words,
for the plan), as verl and TRL call theirs by keyword:

* verl's: ``fn(data_source, solution_str, ground_truth, extra_info)``, called by keyword as verl calls it
  (any function with a ``solution_str`` or a ``data_source`` parameter, or one taking only ``**kwargs``), so
  verl reward files work unchanged. A verl-style function whose response parameter has another name
  (``fn(data_source, solution, ground_truth, extra_info=None)``) is refused as verl refuses it: called
  positionally it would take the response as its data_source and score every sample wrong.
* hybridrl's: ``fn(response, ground_truth, extra)`` (``extra`` holds data_source, extra_info, ...): a function naming
  all three is called by name, in whatever order it lists them; any other is called with three positional
  arguments, in that order (``fn(a, b, c)``: a the response, b the ground truth, c the extra), and refused where one
  of those three names stands in another's place (``fn(ground_truth, response, c)`` would take the response as its
  ground truth).
* TRL's batched functions (``fn(prompts, completions, **kwargs)``, a list of completions a call) are refused: hybridrl
  calls once per sample.

``custom_reward_function.reward_kwargs`` (verl's key) are passed to it as keyword arguments on every
call, in either convention.

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


VERL_OPTIONAL_ARGUMENTS = ("data_source", "extra_info")  # passed to a verl-style function that names them


def _verl_keywords(parameters: Mapping[str, inspect.Parameter]) -> tuple[str, ...] | None:
    """The keyword arguments a verl-style function is called with, or None for hybridrl's positional convention.

    verl calls ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)``: a function naming
    solution_str or data_source (verl's first parameter, never hybridrl's), or taking nothing but ``**kwargs``, is
    verl's. ``data_source`` and ``extra_info`` go to a function naming them or taking ``**kwargs``.
    """
    kinds = {parameter.kind for parameter in parameters.values()}
    only_keywords = inspect.Parameter.VAR_KEYWORD in kinds and not kinds & {
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL}
    if "solution_str" not in parameters and "data_source" not in parameters and not only_keywords:
        return None
    takes_any = inspect.Parameter.VAR_KEYWORD in kinds
    optional = tuple(name for name in VERL_OPTIONAL_ARGUMENTS if name in parameters or takes_any)
    return ("solution_str", "ground_truth", *optional)


OUR_ARGUMENTS = ("response", "ground_truth", "extra")  # hybridrl's call, in its positional order
TRL_BATCH_ARGUMENTS = ("prompts", "completions", "completion_ids")  # TRL's reward functions take a batch a call
# what each argument of a call holds, for the plan's account of it
ARGUMENT_MEANINGS = {
    "response": "the response text", "solution_str": "the response text", "ground_truth": "the row's ground truth",
    "extra": "the row's metadata (data_source, extra_info, index, prompt, reward_spec)",
    "data_source": "the row's data_source", "extra_info": "the row's extra_info",
}
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature_parameters(function: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: only a call can tell


def _ours_by_name(parameters: Mapping[str, inspect.Parameter]) -> bool:
    """Whether hybridrl's call passes the arguments by name: the function names all three (none positional-only)."""
    return all(name in parameters and parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY
               for name in OUR_ARGUMENTS)


def _convention_problem(parameters: Mapping[str, inspect.Parameter]) -> str | None:
    """Why hybridrl's positional call would hand this function's named parameters the wrong values (or a TRL batch
    function a sample), or None. Only for a function that is not verl's and not called by name."""
    trl = [name for name in TRL_BATCH_ARGUMENTS if name in parameters]
    if trl:
        return (f"takes {', '.join(trl)}: TRL's convention, a batch of completions a call; hybridrl calls a reward "
                "function once per sample: define fn(response, ground_truth, extra) or verl's fn(data_source, "
                "solution_str, ground_truth, extra_info)")
    positional = [name for name, parameter in parameters.items() if parameter.kind in _POSITIONAL]
    for position, name in enumerate(positional):
        if name in OUR_ARGUMENTS and (position >= len(OUR_ARGUMENTS) or OUR_ARGUMENTS[position] != name):
            given = (f"the call passes {ARGUMENT_MEANINGS[OUR_ARGUMENTS[position]]}"
                     if position < len(OUR_ARGUMENTS) else "the call passes three arguments")
            return (f"has {name!r} as its parameter {position + 1}, where {given} (called as fn(response, "
                    f"ground_truth, extra), by position): name all three parameters response, ground_truth, extra to "
                    "be called by name, or put it in its place")
    return None


def _call_arguments(parameters: Mapping[str, inspect.Parameter]) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """The arguments the reward call passes a function with these parameters (placeholders), and its form."""
    keywords = _verl_keywords(parameters)
    if keywords is not None:
        kwargs: dict[str, Any] = dict.fromkeys(keywords)
        kwargs["solution_str"] = ""
        form = f"verl's convention, called as fn({', '.join(f'{name}=...' for name in kwargs)})"
        if "solution_str" not in parameters:
            form += ": the response is passed as solution_str"
        return (), kwargs, form
    if _ours_by_name(parameters):
        return (), {"response": "", "ground_truth": None, "extra": {}}, \
            "called as fn(response=..., ground_truth=..., extra=...), by name"
    return ("", None, {}), {}, "called as fn(response, ground_truth, extra)"


def call_form(function: Callable[..., Any], reward_kwargs: Mapping[str, Any] | None = None) -> str:
    """How `adapt_reward_function(function, reward_kwargs)` calls `function`, each argument named with what it holds:
    what the plan says (``compute_score(a=the response text, b=the row's ground truth, c=...), by position``)."""
    name = getattr(function, "__name__", "fn")
    fixed = [f"{key}=<reward_kwargs {key}>" for key in (reward_kwargs or {})]
    parameters = _signature_parameters(function)
    if parameters is None:
        passed = [f"<{ARGUMENT_MEANINGS[argument]}>" for argument in OUR_ARGUMENTS]
        return f"{name}({', '.join([*passed, *fixed])}), by position"
    keywords = _verl_keywords(parameters)
    if keywords is not None:
        passed = [f"{keyword}=<{ARGUMENT_MEANINGS[keyword]}>" for keyword in keywords]
        return f"{name}({', '.join([*passed, *fixed])}), by keyword as verl calls it"
    if _ours_by_name(parameters):
        passed = [f"{argument}=<{ARGUMENT_MEANINGS[argument]}>" for argument in parameters if argument in OUR_ARGUMENTS]
        return f"{name}({', '.join([*passed, *fixed])}), by name"
    positional = [key for key, parameter in parameters.items() if parameter.kind in _POSITIONAL]
    names = positional[:len(OUR_ARGUMENTS)]
    if len(names) < len(OUR_ARGUMENTS) and any(p.kind is inspect.Parameter.VAR_POSITIONAL
                                               for p in parameters.values()):
        names += [f"*{next(k for k, p in parameters.items() if p.kind is inspect.Parameter.VAR_POSITIONAL)}"
                  f"[{i}]" for i in range(len(OUR_ARGUMENTS) - len(names))]
    passed = [f"{key}=<{ARGUMENT_MEANINGS[argument]}>" for key, argument in zip(names, OUR_ARGUMENTS)]
    return f"{name}({', '.join([*passed, *fixed])}), by position"


def call_problem(function: Callable[..., Any],
                 reward_kwargs: Mapping[str, Any] | None = None) -> tuple[str, str] | None:
    """Why `adapt_reward_function(function, reward_kwargs)` could not call `function`, or None when it can (the
    arguments the call would pass are bound to its signature, without calling it), with the field of
    `custom_reward_function` to blame: ("reward_kwargs", why) when the function takes the reward call but not those
    keyword arguments, else ("name", why): also a function whose parameter names say it expects other values than
    the positional call passes (`_convention_problem`)."""
    parameters = _signature_parameters(function)
    if parameters is None:
        return None
    if _verl_keywords(parameters) is None and not _ours_by_name(parameters):
        convention = _convention_problem(parameters)
        if convention is not None:
            return "name", convention
    signature = inspect.signature(function)
    args, kwargs, form = _call_arguments(parameters)
    extra = dict(reward_kwargs or {})
    taken = sorted(set(kwargs) & set(extra))
    if taken:
        return "reward_kwargs", (f"names {', '.join(taken)}, which the reward call passes itself ({form}): rename "
                                 "the keyword argument")
    try:
        signature.bind(*args, **kwargs, **extra)
        return None
    except TypeError as error:
        problem = error
    with_kwargs = f", plus {', '.join(f'{key}=...' for key in extra)} from reward_kwargs" if extra else ""
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return "name", (f"cannot take the reward call ({form}{with_kwargs}): {problem}; define "
                        "fn(response, ground_truth, extra) or verl's fn(data_source, solution_str, ground_truth, "
                        "extra_info)" + (" with a parameter of each reward_kwargs name (or **kwargs)" if extra else ""))
    return "reward_kwargs", (f"cannot be passed to the function {getattr(function, '__name__', function)!r} "
                             f"({form}{with_kwargs}): {problem}; give it a parameter of each name (or **kwargs), or "
                             "remove the key")


def adapt_reward_function(function: Callable[..., Any], reward_kwargs: Mapping[str, Any] | None = None,
                          ) -> Callable[[str, Any, Mapping[str, Any]], ScoreResult]:
    """Wrap a user function into the scorer signature (see the module docstring); `reward_kwargs` are passed to
    it as keyword arguments on every call.

    Return values are converted by the `RewardManager`, which also reports errors with the sample
    index; this wrapper only maps the arguments.
    """
    parameters = _signature_parameters(function)
    # builtins without a signature: our convention
    keywords = _verl_keywords(parameters) if parameters is not None else None
    fixed = dict(reward_kwargs or {})

    if keywords is not None:
        optional = [name for name in VERL_OPTIONAL_ARGUMENTS if name in keywords]

        def verl_style(response: str, ground_truth: Any, extra: Mapping[str, Any]) -> Any:
            kwargs: dict[str, Any] = {"solution_str": response, "ground_truth": ground_truth}
            kwargs.update({name: extra.get(name) for name in optional})
            return function(**kwargs, **fixed)

        return _adapting(verl_style, function)
    if parameters is not None and _ours_by_name(parameters):
        def by_name(response: str, ground_truth: Any, extra: Mapping[str, Any]) -> Any:
            return function(response=response, ground_truth=ground_truth, extra=extra, **fixed)

        return _adapting(by_name, function)
    if not fixed:
        return function

    def ours(response: str, ground_truth: Any, extra: Mapping[str, Any]) -> Any:
        return function(response, ground_truth, extra, **fixed)

    return _adapting(ours, function)


def _adapting(adapter: Callable[..., Any], function: Callable[..., Any]) -> Callable[..., Any]:
    """`adapter` under the user function's name, holding it as `user_function` (whether it is ``async def``: the
    reward processes split an async function's batch into shares, `hybridrl.rewards.isolation`)."""
    adapter.__name__ = getattr(function, "__name__", "custom_reward")
    adapter.user_function = function  # type: ignore[attr-defined]
    return adapter
