"""Scoring decoded responses: per-sequence scores, metrics, and token-level rewards.

`RewardManager` holds one scorer (a registry name or a user function) and scores a batch of decoded
responses with their metadata. Every result must be a finite number: a scorer that raises or
returns NaN / inf / a non-number fails with an error naming the function and the sample (its batch
row, prompt index and data source), or, when ``fallback_score`` is set, that sample gets the fallback
and the event is counted in the metrics (``reward/fallbacks``) with one warning per batch.
An ``async def`` scorer's calls for a batch are awaited together in one event loop.

With ``timeout_s`` (``algorithm.custom_reward_function.timeout_s``, 300 s by default in a job's config) every call
runs in a worker process and may take that long (`hybridrl.rewards.isolation`): a call past it is stopped (its
process killed) and scores like a failure, the fallback or the run's end naming it, counted in
``reward/timeouts`` (and ``reward/fallbacks``) with one warning per batch naming the data sources. ``num_workers``
(``algorithm.custom_reward_function.num_workers``, 1 by default) such processes score a batch's calls at once,
the scores still in the batch's order. Without a timeout, the calls run in this process, unbounded, one after
another (an ``async def`` function's awaited together).

A scorer's extra keys (a dict result's keys beside ``score`` and ``acc``, verl's ``reward_extra_info``) are
kept per sample in ``RewardOutput.details``; each numeric one's mean over the samples that report it is a
metric, ``reward/extra/<key>_mean`` (`extra_metrics`).

Token-level rewards put each sequence's score on its last response token (the token whose action
completed the answer) and zeros elsewhere: ``sequence_scores(token_level_rewards, mask)`` gives the
scores back. A response with no tokens in the mask has no token to carry a score: its row stays zero
and is counted in ``reward/empty_responses``.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridrl.rewards.custom import RewardFunctionError, adapt_reward_function, load_reward_function
from hybridrl.rewards.isolation import Failed, IsolatedScorer, ScorerRecipe, TimedOut, WorkerStartError
from hybridrl.rewards.registry import ScoreResult, get_scorer

logger = logging.getLogger(__name__)

# The setting a user writes to score failing samples instead of stopping (config.schema's CustomRewardConfig).
FALLBACK_FIELD = "algorithm.custom_reward_function.fallback_score"
TIMEOUT_FIELD = "algorithm.custom_reward_function.timeout_s"  # each call's deadline


@dataclass
class RewardOutput:
    scores: list[float]
    accs: list[bool | None]
    metrics: dict[str, float]
    details: list[Mapping[str, Any]] = field(default_factory=list)
    fallback_rows: list[int] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)  # the decoded texts scored (score_batch)


def as_score_result(value: Any) -> ScoreResult | str:
    """A ScoreResult, or the reason `value` is not a usable score."""
    acc: bool | None = None
    details: Mapping[str, Any] = {}
    if isinstance(value, ScoreResult):
        score, acc, details = value.score, value.acc, value.details
    elif isinstance(value, Mapping):
        if "score" not in value:
            return f"returned a dict without a 'score' key: keys {sorted(map(str, value))}"
        score, acc = value["score"], value.get("acc")
        details = {k: v for k, v in value.items() if k not in ("score", "acc")}
    else:
        score = value
    # a 0-d tensor or array (torch.tensor(1.0), np.array(0.5)): its one value, as verl's reward tensor takes it
    score = _plain(score)
    # bool is a Number, but True as a reward is almost always a bug (a predicate returned by mistake)
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        return f"returned {type(score).__name__} {score!r}, not a number"
    score = float(score)
    if not math.isfinite(score):
        return f"returned a non-finite score {score}"
    return ScoreResult(score, None if acc is None else bool(acc), details)


class RewardManager:
    """Scores decoded responses with one scorer; see the module docstring."""

    def __init__(
        self,
        scorer: Callable[[str, Any, Mapping[str, Any]], Any],
        name: str,
        fallback_score: float | None = None,
        timeout_s: float | None = None,
        recipe: ScorerRecipe | None = None,
        num_workers: int = 1,
    ) -> None:
        """`timeout_s`: each call's deadline, the calls then made in `num_workers` worker processes that build the
        scorer from `recipe` (by default, `scorer` itself, which must then pickle: a module's function)."""
        if fallback_score is not None and not math.isfinite(fallback_score):
            raise ValueError(f"fallback_score must be a finite number, got {fallback_score}")
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        if num_workers > 1 and timeout_s is None:
            raise ValueError(f"num_workers={num_workers} needs a timeout_s: without one the calls run in this process")
        self.scorer = scorer
        self.name = name
        self.fallback_score = fallback_score
        self.timeout_s = timeout_s
        self.isolated = None if timeout_s is None else IsolatedScorer(recipe or ScorerRecipe(scorer=scorer), timeout_s,
                                                                      num_workers)

    @classmethod
    def from_name(cls, name: str, fallback_score: float | None = None, timeout_s: float | None = None,
                  num_workers: int = 1, **options: Any) -> RewardManager:
        return cls(get_scorer(name, **options), name, fallback_score, timeout_s,
                   ScorerRecipe(registry=name, options=options), num_workers)

    @classmethod
    def from_file(cls, path: str, function_name: str = "compute_score",
                  fallback_score: float | None = None,
                  reward_kwargs: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                  num_workers: int = 1) -> RewardManager:
        function = load_reward_function(path, function_name)
        return cls(adapt_reward_function(function, reward_kwargs), f"{function_name} from {path}", fallback_score,
                   timeout_s, ScorerRecipe(path=path, function=function_name, reward_kwargs=reward_kwargs),
                   num_workers)

    @classmethod
    def from_config(cls, algorithm_config: Any, fallback_score: float | None = None) -> RewardManager:
        """The user's function when ``custom_reward_function.path`` is set, else the ``reward_fn`` scorer."""
        custom = algorithm_config.custom_reward_function
        if fallback_score is None:
            fallback_score = getattr(custom, "fallback_score", None)
        timeout_s = getattr(custom, "timeout_s", None)
        num_workers = getattr(custom, "num_workers", 1)
        if custom.path:
            return cls.from_file(custom.path, custom.name, fallback_score, getattr(custom, "reward_kwargs", None),
                                 timeout_s, num_workers)
        return cls.from_name(algorithm_config.reward_fn, fallback_score, timeout_s, num_workers)

    def close(self) -> None:
        """Stop the worker processes of a scorer with a deadline (a later batch would start others)."""
        if self.isolated is not None:
            self.isolated.close()

    # ------------------------------------------------------------------------------ scoring
    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardOutput:
        """Score each response; `extras[i]` is row i's metadata (data_source, extra_info, index, ...)."""
        if len(ground_truths) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if extras is None:
            extras = [{} for _ in responses]
        if len(extras) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(extras)} metadata rows")
        scores: list[float] = []
        accs: list[bool | None] = []
        details: list[Mapping[str, Any]] = []
        fallback_rows: list[int] = []
        timed_out: list[int] = []
        first_problem = ""
        returned = self._call_each(responses, ground_truths, extras)
        for row, extra in enumerate(extras):
            value = returned[row]
            cause: BaseException | None = None
            if isinstance(value, TimedOut):
                timed_out.append(row)
                stopped = "its process was stopped" if value.stopped else "it was cancelled"
                problem = f"timed out after {value.seconds:g} s ({TIMEOUT_FIELD}; {stopped})"
            elif isinstance(value, Failed):
                problem, cause = value.problem, value.cause or (_WorkerTraceback(value.trace) if value.trace else None)
            else:
                result = as_score_result(value)
                problem = result if isinstance(result, str) else ""
            if problem:
                where = self._where(row, extra)
                if self.fallback_score is None:
                    remedy = (f"make it return sooner, raise {TIMEOUT_FIELD}, or set {FALLBACK_FIELD}"
                              if isinstance(value, TimedOut) else f"fix the function, or set {FALLBACK_FIELD}")
                    raise RewardFunctionError(
                        f"reward function {self.name!r} {problem} on {where}; {remedy} to a number that such samples "
                        "score instead"
                    ) from cause
                if not isinstance(value, TimedOut):  # timeouts have a warning of their own
                    first_problem = first_problem or f"{problem} on {where}"
                fallback_rows.append(row)
                result = ScoreResult(self.fallback_score, None, {"fallback": problem})
            assert isinstance(result, ScoreResult)
            scores.append(result.score)
            accs.append(result.acc)
            details.append(plain_details(result.details))
        data_sources = [str(extra.get("data_source", "unknown")) for extra in extras]
        if timed_out:
            by_source = {source: sum(1 for row in timed_out if data_sources[row] == source)
                         for source in dict.fromkeys(data_sources[row] for row in timed_out)}
            logger.warning(
                "reward function %r timed out after %g s (%s) on %d of %d samples, each scored the fallback %s; by "
                "data_source: %s; first: %s", self.name, self.timeout_s, TIMEOUT_FIELD, len(timed_out),
                len(responses), self.fallback_score, ", ".join(f"{s!r} {n}" for s, n in by_source.items()),
                self._where(timed_out[0], extras[timed_out[0]]),
            )
        if len(fallback_rows) > len(timed_out):
            logger.warning(
                "reward function %r failed on %d of %d samples (fallback score %s), first: %s",
                self.name, len(fallback_rows) - len(timed_out), len(responses), self.fallback_score, first_problem,
            )
        metrics = reward_metrics(scores, accs, data_sources)
        metrics.update(extra_metrics(details))
        metrics["reward/fallbacks"] = float(len(fallback_rows))
        metrics["reward/timeouts"] = float(len(timed_out))
        return RewardOutput(scores, accs, metrics, details, fallback_rows)

    def _call_each(self, responses: Sequence[str], ground_truths: Sequence[Any],
                   extras: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Each sample's scorer return value, `Failed` or `TimedOut`: in the worker processes under the deadline, or
        here without one."""
        if self.isolated is None:
            return _call_each(self.scorer, responses, ground_truths, extras)
        try:
            return self.isolated.call_each(responses, ground_truths, extras)
        except WorkerStartError as error:
            raise RewardFunctionError(f"reward function {self.name!r}: {error}") from error

    @staticmethod
    def _where(row: int, extra: Mapping[str, Any]) -> str:
        context = []
        if extra.get("index") is not None:
            context.append(f"prompt index {extra['index']}")
        if extra.get("data_source") is not None:
            context.append(f"data_source {extra['data_source']!r}")
        return f"sample {row}" + (f" ({', '.join(context)})" if context else "")

    def score_batch(self, batch: Any, tokenizer: Any) -> tuple[Any, RewardOutput]:
        """Decode ``responses`` under ``response_mask`` and score them with the batch's metadata.

        Returns ``(token_level_rewards [B, R], RewardOutput)``. Metadata columns used when present:
        ``ground_truth`` (required), ``data_source``, ``extra_info``, ``reward_spec``, ``index``,
        ``raw_prompt`` (passed as ``extra["prompt"]``).
        """
        responses_ids = batch["responses"]
        response_mask = batch["response_mask"]
        texts = [
            tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(responses_ids, response_mask)
        ]
        rows = len(texts)
        columns = {
            key: batch.non_tensors[key] for key in ("data_source", "extra_info", "reward_spec", "index", "raw_prompt")
            if key in batch.non_tensors
        }
        extras = [
            {("prompt" if key == "raw_prompt" else key): _plain(values[i]) for key, values in columns.items()}
            for i in range(rows)
        ]
        ground_truths = [_plain(value) for value in batch["ground_truth"]]
        output = self.score(texts, ground_truths, extras)
        output.responses = texts
        rewards = token_level_rewards(output.scores, response_mask)
        output.metrics["reward/empty_responses"] = float((response_mask.sum(dim=-1) == 0).sum().item())
        return rewards, output


class _WorkerTraceback(Exception):
    """The traceback of an exception a scorer raised in the worker process (its text: the exception itself stays
    there)."""


def _call_each(scorer: Callable[..., Any], responses: Sequence[str], ground_truths: Sequence[Any],
               extras: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each sample's scorer return value (or `Failed`, when it raised). An `async def` scorer's coroutines are awaited
    together in one event loop, as verl's reward loop awaits them, so a scorer that waits on a remote judge waits once
    per batch, not once per sample."""
    returned: list[Any] = []
    for response, ground_truth, extra in zip(responses, ground_truths, extras):
        try:
            returned.append(scorer(response, ground_truth, extra))
        except Exception as error:
            returned.append(_raised(error))
    pending = [row for row, value in enumerate(returned) if inspect.isawaitable(value)]
    if pending:
        async def await_all() -> list[Any]:
            return await asyncio.gather(*(returned[row] for row in pending), return_exceptions=True)

        for row, value in zip(pending, asyncio.run(await_all())):
            if isinstance(value, BaseException) and not isinstance(value, Exception):
                raise value  # KeyboardInterrupt, SystemExit: not the sample's failure
            returned[row] = _raised(value) if isinstance(value, Exception) else value
    return returned


def _raised(error: Exception) -> Failed:
    return Failed(f"raised {type(error).__name__}: {error}", cause=error)


def _plain(value: Any) -> Any:
    """numpy scalars from metadata arrays as Python values (user functions expect int, not np.int64)."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value


def reward_metrics(scores: Sequence[float], accs: Sequence[bool | None],
                   data_sources: Sequence[str] | None = None) -> dict[str, float]:
    """Mean/min/max score and accuracy (over samples that report one), overall and per data source."""
    metrics: dict[str, float] = {}
    if not scores:
        return metrics

    def add(prefix: str, rows: list[int]) -> None:
        values = [scores[i] for i in rows]
        metrics[f"{prefix}score_mean"] = sum(values) / len(values)
        metrics[f"{prefix}score_min"] = min(values)
        metrics[f"{prefix}score_max"] = max(values)
        judged = [accs[i] for i in rows if accs[i] is not None]
        if judged:
            metrics[f"{prefix}acc"] = sum(1.0 for a in judged if a) / len(judged)

    add("reward/", list(range(len(scores))))
    if data_sources is not None and len(set(data_sources)) > 1:
        for source in sorted(set(data_sources)):
            add(f"reward/{source}/", [i for i, s in enumerate(data_sources) if s == source])
    return metrics


EXTRA_METRIC_PREFIX = "reward/extra/"


def extra_metrics(details: Sequence[Mapping[str, Any]], prefix: str = EXTRA_METRIC_PREFIX,
                  suffix: str = "_mean") -> dict[str, float]:
    """`prefix<key>suffix`: the mean of each numeric extra key (bools as 0/1) over the samples reporting it as a
    finite number; text and other values are not averaged (they are in the rollout and validation dumps)."""
    values: dict[str, list[float]] = {}
    for row in details:
        for key, value in row.items():
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                values.setdefault(str(key), []).append(float(value))
    return {f"{prefix}{key}{suffix}": sum(found) / len(found) for key, found in sorted(values.items())}


def plain_details(details: Mapping[str, Any]) -> dict[str, Any]:
    """A sample's extra keys as JSON values (numbers, text, bools, None, lists and dicts of them; anything else as
    its text): what the batch carries to the dumps, and to the workers with it."""
    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            return plain(value.item())
        return str(value)

    return {str(key): plain(value) for key, value in details.items()}


def token_level_rewards(scores: Sequence[float] | Any, response_mask: Any) -> Any:
    """[B, R] float tensor: score i on row i's last response token (mask 1), zeros elsewhere.

    "Last" is the last position whose mask is 1, so right-padded responses and masks with holes
    (e.g. tool output masked out in multi-turn) both work. Rows with an empty mask stay all zero.
    """
    import torch

    mask = torch.as_tensor(response_mask)
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(mask.shape)}")
    score_tensor = torch.as_tensor(scores, dtype=torch.float32)
    if score_tensor.shape != (mask.shape[0],):
        raise ValueError(f"{tuple(score_tensor.shape)} scores for a response mask of {mask.shape[0]} rows")
    valid = mask != 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).flatten()
    rewards[rows, last[rows]] = score_tensor.to(mask.device)[rows]
    return rewards
