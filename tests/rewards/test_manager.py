"""RewardManager: user reward files, failures (raise/NaN/non-number) and fallbacks, metrics,
token-level reward placement, and scoring a decoded Batch."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from hybridrl.algorithms.advantages import sequence_scores
from hybridrl.config.schema import AlgorithmConfig, CustomRewardConfig
from hybridrl.data.batch import Batch
from hybridrl.data.tokenizer import char_tokenizer
from hybridrl.rewards.custom import RewardFunctionError, call_problem, load_reward_function
from hybridrl.rewards.isolation import AWAIT_GRACE_S
from hybridrl.rewards.manager import RewardManager, token_level_rewards
from hybridrl.rewards.registry import ScoreResult, UnknownScorerError

USER_FILE = '''
import math

def compute_score(response, ground_truth, extra):
    return 1.0 if response.strip() == str(ground_truth) else 0.0

def as_dict(response, ground_truth, extra):
    return {"score": len(response) / 10, "acc": response == ground_truth}

def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth) + (0.5 if data_source == "bonus" else 0.0)

def explodes(response, ground_truth, extra):
    if response == "boom":
        raise KeyError("missing field")
    return 1.0

def weighted(response, ground_truth, extra, weight, bonus=0.0):
    return weight * (response == ground_truth) + bonus

def verl_weighted(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return kwargs["weight"] * (solution_str == ground_truth)

def not_a_number(response, ground_truth, extra):
    return {"nan": math.nan, "inf": math.inf, "text": "1.0", "bool": True}.get(response, 0.5)

NOT_CALLABLE = 3
'''


@pytest.fixture()
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def test_loads_a_user_function(user_file: Path) -> None:
    manager = RewardManager.from_file(str(user_file), "compute_score")
    output = manager.score([" 42 ", "41"], ["42", "42"])
    assert output.scores == [1.0, 0.0]
    assert output.metrics["reward/score_mean"] == 0.5


def test_dict_results_and_verl_signature(user_file: Path) -> None:
    output = RewardManager.from_file(str(user_file), "as_dict").score(["abcde", "x"], ["abcde", "y"])
    assert output.scores == [0.5, 0.1]
    assert output.accs == [True, False]
    assert output.metrics["reward/acc"] == 0.5
    verl = RewardManager.from_file(str(user_file), "verl_style")
    output = verl.score(["a", "a"], ["a", "b"], [{"data_source": "bonus"}, {"data_source": "plain"}])
    assert output.scores == [1.5, 0.0]
    assert output.metrics["reward/bonus/score_mean"] == 1.5  # per data source when there are several


def test_missing_file_and_function_are_clear_errors(user_file: Path, tmp_path: Path) -> None:
    with pytest.raises(RewardFunctionError, match="does not exist"):
        load_reward_function(tmp_path / "nope.py")
    with pytest.raises(RewardFunctionError, match=r"no function 'compute_scor'.*'compute_score'"):
        load_reward_function(user_file, "compute_scor")
    with pytest.raises(RewardFunctionError, match="is a int, not a function"):
        load_reward_function(user_file, "NOT_CALLABLE")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardFunctionError, match="importing custom reward file .*broken.py.* failed"):
        load_reward_function(broken)


def test_raising_function_names_function_and_sample(user_file: Path) -> None:
    manager = RewardManager.from_file(str(user_file), "explodes")
    extras = [{"index": 10, "data_source": "d"}, {"index": 11, "data_source": "d"}]
    expected = (r"'explodes from .*' raised KeyError.* on sample 1 \(prompt index 11.*; fix the function, or set "
                r"algorithm\.custom_reward_function\.fallback_score to a number")
    with pytest.raises(RewardFunctionError, match=expected):
        manager.score(["fine", "boom"], ["x", "x"], extras)


@pytest.mark.parametrize(
    ("response", "problem"),
    [("nan", "non-finite score nan"), ("inf", "non-finite score inf"), ("text", "str '1.0', not a number"),
     ("bool", "bool True, not a number")],
)
def test_non_numbers_are_refused(user_file: Path, response: str, problem: str) -> None:
    manager = RewardManager.from_file(str(user_file), "not_a_number")
    with pytest.raises(RewardFunctionError, match=rf"not_a_number.*{problem}.*sample 1"):
        manager.score(["ok", response], ["x", "x"])


def test_zero_dimensional_tensors_and_arrays_are_their_value() -> None:
    """A function computing its score with torch or numpy may return a 0-d tensor or array (verl's reward tensor takes
    it): its value is the score; a tensor of several values, or a 0-d boolean, is still refused."""
    import numpy as np

    results = iter([torch.tensor(0.75), np.array(0.25), {"score": torch.tensor(1.0, dtype=torch.float64), "acc": True},
                    np.float32(0.5)])
    output = RewardManager(lambda *a: next(results), "f").score(["a"] * 4, ["a"] * 4)
    assert output.scores == [0.75, 0.25, 1.0, 0.5] and all(type(score) is float for score in output.scores)
    for bad, problem in ((torch.tensor([1.0, 2.0]), "Tensor"), (torch.tensor(True), "bool True")):
        with pytest.raises(RewardFunctionError, match=f"returned {problem}"):
            RewardManager(lambda *a, bad=bad: bad, "f").score(["a"], ["a"])


def test_fallback_score_replaces_failures_and_counts_them(user_file: Path, caplog) -> None:
    manager = RewardManager.from_file(str(user_file), "not_a_number", fallback_score=-1.0)
    with caplog.at_level(logging.WARNING, logger="hybridrl.rewards.manager"):
        output = manager.score(["ok", "nan", "text", "ok"], ["x"] * 4)
    assert output.scores == [0.5, -1.0, -1.0, 0.5]
    assert output.fallback_rows == [1, 2]
    assert output.metrics["reward/fallbacks"] == 2.0
    assert "failed on 2 of 4 samples" in caplog.text
    raising = RewardManager.from_file(str(user_file), "explodes", fallback_score=0.0)
    assert raising.score(["boom"], ["x"]).scores == [0.0]
    with pytest.raises(ValueError, match="finite"):
        RewardManager(lambda *a: 1.0, "f", fallback_score=float("nan"))


def test_from_config_picks_custom_or_registry(user_file: Path) -> None:
    assert RewardManager.from_config(AlgorithmConfig(reward_fn="countdown")).name == "countdown"
    custom = AlgorithmConfig(custom_reward_function=CustomRewardConfig(path=str(user_file), name="as_dict"))
    assert RewardManager.from_config(custom).score(["abc"], ["abc"]).accs == [True]
    with pytest.raises(UnknownScorerError, match="Did you mean 'countdown'"):
        RewardManager.from_config(AlgorithmConfig(reward_fn="count_down"))
    pooled = AlgorithmConfig(custom_reward_function=CustomRewardConfig(path=str(user_file), num_workers=3))
    isolated = RewardManager.from_config(pooled).isolated
    assert isolated is not None and (isolated.num_workers, isolated.timeout_s) == (3, 300.0)
    with pytest.raises(ValueError, match="num_workers=3 needs a timeout_s"):
        RewardManager.from_config(AlgorithmConfig(custom_reward_function=CustomRewardConfig(
            path=str(user_file), num_workers=3, timeout_s=None)))


def test_reward_kwargs_reach_the_function_on_every_call(user_file: Path) -> None:
    """verl's custom_reward_function.reward_kwargs: keyword arguments of every call, in either convention."""
    ours = AlgorithmConfig(custom_reward_function=CustomRewardConfig(
        path=str(user_file), name="weighted", reward_kwargs={"weight": 2.0, "bonus": 0.25}))
    assert RewardManager.from_config(ours).score(["a", "b"], ["a", "a"]).scores == [2.25, 0.25]
    verl = AlgorithmConfig(custom_reward_function=CustomRewardConfig(
        path=str(user_file), name="verl_weighted", reward_kwargs={"weight": 3.0}))
    output = RewardManager.from_config(verl).score(["a", "b"], ["a", "a"], [{"data_source": "x"}] * 2)
    assert output.scores == [3.0, 0.0]


VERL_VARIANTS = '''
def only_kwargs(**kwargs):
    # verl calls by keyword: every argument arrives, extra_info included
    return float(kwargs["solution_str"] == kwargs["ground_truth"]) + kwargs["extra_info"]["bonus"]

def named_and_kwargs(solution_str, ground_truth, **kwargs):
    return float(solution_str == ground_truth) + (0.5 if kwargs["data_source"] == "bonus" else 0.0)

def response_misnamed(data_source, solution, ground_truth, extra_info=None):
    return float(solution == ground_truth)
'''


def test_verl_style_functions_are_called_by_keyword_as_verl_calls_them(tmp_path: Path) -> None:
    """verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=): a function taking
    **kwargs gets all four. One whose response parameter has another name fails there; called positionally it
    would take the response as its data_source and the ground truth as the response, scoring every sample 0."""
    path = tmp_path / "verl_variants.py"
    path.write_text(VERL_VARIANTS)
    extras = [{"data_source": "bonus", "extra_info": {"bonus": 0.25}}, {"data_source": "x", "extra_info": {"bonus": 0}}]
    assert RewardManager.from_file(str(path), "only_kwargs").score(["a", "b"], ["a", "a"], extras).scores == [1.25, 0.0]
    assert RewardManager.from_file(str(path), "named_and_kwargs").score(["a", "a"], ["a", "a"], extras).scores == \
        [1.5, 1.0]
    misnamed = load_reward_function(path, "response_misnamed")
    field, problem = call_problem(misnamed)
    assert field == "name" and "missing a required argument: 'solution'" in problem, problem
    assert "the response is passed as solution_str" in problem
    with pytest.raises(RewardFunctionError, match="unexpected keyword argument 'solution_str'"):
        RewardManager.from_file(str(path), "response_misnamed").score(["a"], ["a"], extras[:1])


ASYNC_REWARD = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0.3)  # a remote judge
    if solution_str == "boom":
        raise ValueError("the judge refused")
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}
'''


def test_async_reward_functions_are_awaited_together(tmp_path: Path) -> None:
    """An `async def` reward function (verl's reward loop awaits them): its scores, not "returned coroutine"; the
    batch's calls wait concurrently; one that raises is that sample's failure, named or given the fallback."""
    import time

    path = tmp_path / "judge.py"
    path.write_text(ASYNC_REWARD)
    manager = RewardManager.from_file(str(path))
    started = time.monotonic()
    output = manager.score(["a", "b", "c", "d", "e", "f"], ["a", "a", "c", "c", "e", "x"])
    assert output.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0] and output.accs == [True, False, True, False, True, False]
    assert time.monotonic() - started < 6 * 0.3 / 2  # one after another would take 1.8 s
    with pytest.raises(RewardFunctionError, match=r"raised ValueError: the judge refused on sample 1 \(prompt index 7"):
        manager.score(["a", "boom"], ["a", "a"], [{"index": 6}, {"index": 7}])
    fallback = RewardManager.from_file(str(path), fallback_score=-1.0).score(["a", "boom"], ["a", "a"])
    assert fallback.scores == [1.0, -1.0] and fallback.fallback_rows == [1]


def test_a_reward_file_imports_its_neighbours(tmp_path: Path) -> None:
    """A reward file split into modules, as a script beside them would import them: relatively (`from .helper`),
    by name at import time (`import grading`) and by name inside the function (a lazy import at the first score).
    The folder ends last on sys.path, where it shadows nothing the trainer imports later."""
    import sys

    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "helper.py").write_text("def same(a, b):\n    return float(a.strip() == b)\n")
    (folder / "grading.py").write_text("BONUS = 0.5\n")
    (folder / "lazy_bonus.py").write_text("BONUS = 0.25\n")
    (folder / "reward-v2.py").write_text(
        "from .helper import same\nimport grading\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    import lazy_bonus\n"
        "    return same(solution_str, ground_truth) + grading.BONUS + lazy_bonus.BONUS\n")
    try:
        manager = RewardManager.from_file(str(folder / "reward-v2.py"))
        assert sys.path[-1] == str(folder.resolve()) and str(folder.resolve()) not in sys.path[:-1]
        assert manager.score([" a ", "b"], ["a", "a"]).scores == [1.75, 0.75]
    finally:
        sys.path.remove(str(folder.resolve()))
        for name in ("grading", "lazy_bonus"):
            sys.modules.pop(name, None)


def test_extra_keys_are_kept_per_sample_and_each_numeric_ones_mean_is_a_metric() -> None:
    """verl's reward_extra_info: the dict's keys beside score and acc, per sample (as JSON values), and the mean of
    each numeric one over the samples that report it."""
    import numpy as np

    results = iter([{"score": 1.0, "acc": True, "my_len": 3, "tag": "ok", "ratio": np.float32(0.5)},
                    {"score": 0.0, "my_len": 5, "tag": "bad", "ok": True, "ratio": float("nan")},
                    {"score": 0.5, "my_len": np.int64(7), "shape": (1, 2)}])
    output = RewardManager(lambda *a: next(results), "f").score(["a", "b", "c"], ["a", "a", "a"])
    first, second, third = output.details
    assert first == {"my_len": 3, "tag": "ok", "ratio": 0.5} and third == {"my_len": 7, "shape": [1, 2]}
    assert math.isnan(second.pop("ratio")) and second == {"my_len": 5, "tag": "bad", "ok": True}
    assert type(third["my_len"]) is int and type(first["ratio"]) is float  # numpy's as Python's: JSON-ready
    extra = {k: v for k, v in output.metrics.items() if k.startswith("reward/extra/")}
    assert extra == {"reward/extra/my_len_mean": 5.0, "reward/extra/ok_mean": 1.0, "reward/extra/ratio_mean": 0.5}


def test_registry_scorer_metrics() -> None:
    output = RewardManager.from_name("gsm8k").score(["#### 3", "#### 4", "nothing"], ["3", "3", "3"])
    assert output.scores == [1.0, 0.0, 0.0]
    assert output.metrics["reward/acc"] == pytest.approx(1 / 3)
    assert output.metrics["reward/score_max"] == 1.0 and output.metrics["reward/score_min"] == 0.0
    assert output.details[0]["answer"] == "3"


def test_token_level_rewards_on_the_last_response_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    rewards = token_level_rewards([0.5, -1.0, 2.0, 3.0, 0.25], mask)
    assert rewards.tolist() == [
        [0.0, 0.0, 0.5, 0.0],
        [-1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, 0.0, 0.0],  # empty response: no token can carry the score
        [0.0, 0.0, 0.25, 0.0],  # a mask with a hole: the last valid token
    ]
    assert rewards.dtype == torch.float32
    # the advantage code reads the sequence score back from the token rewards
    assert sequence_scores(rewards, mask).tolist() == [0.5, -1.0, 2.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="scores for a response mask of 5 rows"):
        token_level_rewards([1.0], mask)


def test_score_batch_decodes_under_the_mask() -> None:
    tokenizer = char_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = [ids("aaaa") + [eos, pad], ids("ab") + [eos, pad, pad, pad], ids("cccccc"), [pad] * 6]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0] * 6])
    batch = Batch(
        tensors={"responses": torch.tensor(rows), "response_mask": mask},
        non_tensors={
            "ground_truth": ["aaaa", "aaaa", "cccc", "bbbb"],
            "data_source": ["hybridrl/repeat_letter"] * 4,
            "index": [0, 1, 2, 3],
        },
    )
    rewards, output = RewardManager.from_name("repeat_letter").score_batch(batch, tokenizer)
    assert output.scores == [1.0, 0.25, 1.0, 0.0]
    assert rewards[0].tolist() == [0, 0, 0, 0, 1.0, 0]  # on the EOS, the last response token
    assert rewards[1, 2].item() == 0.25
    assert rewards[2, 5].item() == 1.0
    assert output.metrics["reward/empty_responses"] == 1.0


def test_scorer_protocol_results_pass_through() -> None:
    manager = RewardManager(lambda r, g, e: ScoreResult(0.75, True, {"why": "test"}), "inline")
    output = manager.score(["x"], [None])
    assert (output.scores, output.accs, output.details) == ([0.75], [True], [{"why": "test"}])


def test_auto_scores_each_row_by_its_data_source_as_verls_default_reward():
    """verl's GSM8K + MATH jobs: algorithm.reward_fn=auto (the default) scores each row with the scorer its
    data_source names; one scorer for all (the old default, gsm8k) gets the MATH rows wrong."""
    from hybridrl.rewards.registry import get_scorer

    responses = ["so 42.\n#### 42", "The answer is \\boxed{\\frac{1}{2}}", "#### 7", "\\boxed{3}"]
    truths = ["42", "\\frac{1}{2}", "8", "3"]
    sources = ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k", "lighteval/MATH"]
    extras = [{"data_source": s} for s in sources]
    manager = RewardManager.from_config(AlgorithmConfig())
    assert AlgorithmConfig().reward_fn == "auto"
    output = manager.score(responses, truths, extras)
    expected = [get_scorer("gsm8k" if s == "openai/gsm8k" else "math")(r, t, e).score
                for r, t, s, e in zip(responses, truths, sources, extras)]
    assert output.scores == expected == [1.0, 1.0, 0.0, 1.0]
    one_for_all = RewardManager.from_name("gsm8k").score(responses, truths, extras).scores
    assert one_for_all != expected  # the MATH rows' boxed answers
    with pytest.raises(RewardFunctionError, match="raised UnknownScorerError: no scorer for data_source 'aime24'") \
            as info:
        manager.score(["x"], ["1"], [{"data_source": "aime24"}])
    # raised in the scorer's process (the config's timeout_s): its traceback is the cause's text
    assert "UnknownScorerError: no scorer for data_source 'aime24'" in str(info.value.__cause__)
    assert "in by_data_source" in str(info.value.__cause__)


def test_fallback_field_named_in_errors_is_the_schemas() -> None:
    """The error tells the user a setting to write: it must be one the config has (a float, off by default)."""
    from hybridrl.config.schema import JobConfig
    from hybridrl.rewards.manager import FALLBACK_FIELD

    node: object = JobConfig()
    for part in FALLBACK_FIELD.split("."):
        node = getattr(node, part)
    assert node is None


HANGING_REWARD = '''
import asyncio, os, re, time

def compute_score(response, ground_truth, extra):
    if response == "hang":  # catastrophic backtracking: 2**30 steps inside re's C code, holding the GIL
        open(extra["extra_info"]["pid_file"], "w").write(str(os.getpid()))
        re.match(r"(a+)+$", "a" * 30 + "b")
    return float(response == ground_truth)

async def judge(response, ground_truth, extra):
    if response == "wait":
        await asyncio.sleep(60)  # a remote judge that never answers: cancelled at the deadline
    if response == "block":
        time.sleep(60)  # blocking work inside async def: holds the whole event loop
    await asyncio.sleep(0.05)
    return float(response == ground_truth)
'''


def _hanging_batch(tokenizer, texts: list[str], sources: list[str], pid_file: Path) -> Batch:
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, rows))
    return Batch(
        tensors={"responses": torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]),
                 "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])},
        non_tensors={"ground_truth": ["a"] * len(texts), "data_source": sources, "index": list(range(len(texts))),
                     "extra_info": [{"pid_file": str(pid_file)}] * len(texts)})


def test_a_hanging_reward_call_is_stopped_at_its_deadline_and_scores_the_fallback(tmp_path: Path, caplog) -> None:
    """algorithm.custom_reward_function.timeout_s: a call past it is stopped, its process killed (a CPU-bound regex
    stops burning its core), the sample scores fallback_score, counted in reward/timeouts, and the warning names the
    function and the data_source; the scoring goes on in a new process. Without a fallback the run stops naming
    the sample and both settings."""
    import os
    import time

    path = tmp_path / "slow_reward.py"
    path.write_text(HANGING_REWARD)
    pid_file = tmp_path / "pid"
    config = AlgorithmConfig(custom_reward_function=CustomRewardConfig(path=str(path), timeout_s=1.0,
                                                                       fallback_score=-1.0))
    manager = RewardManager.from_config(config)
    tokenizer = char_tokenizer()
    texts, sources = ["a", "hang", "b", "a"], ["fast/src", "regex/src", "fast/src", "fast/src"]
    started = time.monotonic()
    manager.score(["a"], ["a"])  # the worker started (each call's deadline counts from the call's start)
    start = time.monotonic() - started  # what starting one costs on this machine now
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridrl.rewards.manager"):
        rewards, output = manager.score_batch(_hanging_batch(tokenizer, texts, sources, pid_file), tokenizer)
    elapsed = time.monotonic() - started
    # the deadline and a new worker, with room for this machine's load (start-up measures it); unbounded: minutes
    assert elapsed < 1.0 + 3 * start + 1.0, (elapsed, start)
    assert output.scores == [1.0, -1.0, 0.0, 1.0]  # the fallback, and the others' own scores
    assert rewards[1, 3].item() == -1.0  # on the last token of "hang"
    assert output.metrics["reward/timeouts"] == 1.0 and output.metrics["reward/fallbacks"] == 1.0
    assert output.fallback_rows == [1]
    assert "timed out after 1 s" in output.details[1]["fallback"]
    assert (f"reward function 'compute_score from {path}' timed out after 1 s "
            "(algorithm.custom_reward_function.timeout_s) on 1 of 4 samples") in caplog.text
    assert "by data_source: 'regex/src' 1; first: sample 1 (prompt index 1, data_source 'regex/src')" in caplog.text
    with pytest.raises(ProcessLookupError):  # the process that ran the regex is gone, not burning a core
        os.kill(int(pid_file.read_text()), 0)
    assert manager.score(["a", "b"], ["a", "a"]).scores == [1.0, 0.0]  # a new process scores on
    stop = RewardManager.from_file(str(path), timeout_s=0.5)
    with pytest.raises(RewardFunctionError, match=(
            r"timed out after 0.5 s \(algorithm.custom_reward_function.timeout_s; its process was stopped\) on sample "
            r"0 \(data_source 'regex/src'\); make it return sooner, raise algorithm.custom_reward_function.timeout_s, "
            r"or set algorithm.custom_reward_function.fallback_score")):
        stop.score(["hang"], ["a"], [{"data_source": "regex/src", "extra_info": {"pid_file": str(pid_file)}}])
    manager.close()
    stop.close()
    with pytest.raises(ValueError, match="a scorer with a time limit runs in a process of its own, which cannot "
                                         "rebuild <function .*<lambda>"):
        RewardManager(lambda *a: 1.0, "inline", timeout_s=1.0)


def test_an_async_reward_call_past_its_deadline_times_out_alone(tmp_path: Path) -> None:
    """An async function's calls are awaited together, each under the deadline: one that never answers is cancelled
    at it; one that blocks the event loop is found by running the unanswered calls again one at a time, so only it
    scores the fallback and the others keep their own scores."""
    import time

    path = tmp_path / "slow_reward.py"
    path.write_text(HANGING_REWARD)
    manager = RewardManager.from_file(str(path), "judge", fallback_score=-1.0, timeout_s=1.0)
    started = time.monotonic()
    manager.score(["a"], ["a"])  # the worker started
    start = time.monotonic() - started  # what starting one costs on this machine now
    started = time.monotonic()
    waited = manager.score(["a", "wait", "b", "a"], ["a"] * 4)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + max(1.0, 3 * start), (elapsed, start)  # the deadline and load's room; unbounded: 60 s
    assert waited.scores == [1.0, -1.0, 0.0, 1.0] and waited.metrics["reward/timeouts"] == 1.0
    assert "it was cancelled" in waited.details[1]["fallback"]
    started = time.monotonic()
    blocked = manager.score(["a", "block", "b", "a"], ["a"] * 4)
    # the batch's deadline and grace, then the unanswered calls one at a time (the blocking one to its deadline)
    elapsed = time.monotonic() - started
    assert elapsed < 2 * 1.0 + AWAIT_GRACE_S + 3 * start + 1.0, (elapsed, start)  # unbounded: 60 s
    assert blocked.scores == [1.0, -1.0, 0.0, 1.0] and blocked.metrics["reward/timeouts"] == 1.0
    assert "its process was stopped" in blocked.details[1]["fallback"]
    manager.close()


NAMED_REWARDS = '''
def meaningless(a, b, c):
    return {"score": 1.0, "a": a, "b": b, "c_source": c["data_source"]}

def by_name(ground_truth, extra, response):  # hybridrl's three names, in its own order
    return {"score": float(response == ground_truth), "response": response, "ground_truth": ground_truth,
            "source": extra["data_source"]}

def swapped(ground_truth, response, c):
    return float(response == ground_truth)

def trl_batch(prompts, completions, **kwargs):
    return [1.0 for _ in completions]
'''


def test_how_a_reward_function_is_called_follows_its_parameter_names(tmp_path: Path) -> None:
    """verl and TRL call reward functions by keyword. hybridrl calls one naming response, ground_truth and extra by
    name (any order), one with meaningless names by position (response, ground_truth, extra), saying which argument
    gets what; one whose names stand in another's place, or TRL's batched one, is refused naming the field."""
    from hybridrl.rewards.custom import call_form

    path = tmp_path / "named.py"
    path.write_text(NAMED_REWARDS)
    extras = [{"data_source": "src/a"}, {"data_source": "src/b"}]
    positional = RewardManager.from_file(str(path), "meaningless").score(["resp", "other"], ["gt", "gt"], extras)
    assert [(d["a"], d["b"], d["c_source"]) for d in positional.details] == [("resp", "gt", "src/a"),
                                                                              ("other", "gt", "src/b")]
    assert call_form(load_reward_function(path, "meaningless")) == (
        "meaningless(a=<the response text>, b=<the row's ground truth>, c=<the row's metadata (data_source, "
        "extra_info, index, prompt, reward_spec)>), by position")
    named = RewardManager.from_file(str(path), "by_name").score(["x", "x"], ["x", "y"], extras)
    assert named.scores == [1.0, 0.0]  # positionally, ground_truth would be the response and response the extra
    assert [(d["response"], d["ground_truth"], d["source"]) for d in named.details] == [("x", "x", "src/a"),
                                                                                        ("x", "y", "src/b")]
    assert call_form(load_reward_function(path, "by_name"), {"weight": 2}).endswith(
        "response=<the response text>, weight=<reward_kwargs weight>), by name")
    field, problem = call_problem(load_reward_function(path, "swapped"))
    assert field == "name" and problem.startswith(
        "has 'ground_truth' as its parameter 1, where the call passes the response text (called as fn(response, "
        "ground_truth, extra), by position)"), problem
    field, problem = call_problem(load_reward_function(path, "trl_batch"))
    assert field == "name" and "takes prompts, completions: TRL's convention" in problem


POOL_REWARD = '''
import asyncio, hashlib, os, time

def digest(text):
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32

def compute_score(response, ground_truth, extra):
    if response == "hang":
        open(extra["extra_info"]["pid_file"], "w").write(str(os.getpid()))
        time.sleep(600)
    if response == "exit":
        os._exit(3)  # ends its own process, as a crashing extension would
    time.sleep(float(extra.get("extra_info", {}).get("sleep", 0.0)))
    return {"score": digest(response), "pid": os.getpid()}

async def judge(response, ground_truth, extra):
    if response == "block":
        time.sleep(600)  # blocking work inside async def: holds its process's whole event loop
    await asyncio.sleep(1.0)  # a remote judge
    return {"score": digest(response), "pid": os.getpid()}
'''


def _digest(text: str) -> float:
    import hashlib

    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32


@pytest.fixture()
def pool_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool_reward.py"
    path.write_text(POOL_REWARD)
    return path


def test_num_workers_score_a_batchs_calls_at_once_and_in_its_order(pool_file: Path) -> None:
    """algorithm.custom_reward_function.num_workers: 8 calls of 1 s on 4 processes take about 2 s, not 8; each score is
    its own sample's (derived from its response), whichever process answered first; the processes are started once
    and serve the next batch."""
    import time

    manager = RewardManager.from_file(str(pool_file), timeout_s=30.0, num_workers=4)
    assert manager.isolated is not None and manager.isolated.num_workers == 4
    manager.score(["w0", "w1", "w2", "w3"], ["x"] * 4)  # the processes started
    pids = sorted(manager.isolated.pids)
    assert len(pids) == 4
    texts = [f"sample {i}" for i in range(8)]
    started = time.monotonic()
    output = manager.score(texts, ["x"] * 8, [{"extra_info": {"sleep": 1.0}}] * 8)
    elapsed = time.monotonic() - started
    assert elapsed < 4.0, elapsed  # one after another: 8 s
    assert output.scores == [_digest(text) for text in texts]  # each its own, in the batch's order
    assert {detail["pid"] for detail in output.details} == set(pids)  # all four took calls
    assert sorted(manager.isolated.pids) == pids  # the same processes, batch after batch
    manager.close()
    assert manager.isolated.pids == []


def test_a_call_past_its_deadline_in_the_pool_times_out_alone_and_the_pool_goes_on(pool_file: Path,
                                                                                      tmp_path: Path) -> None:
    """One call that hangs is killed with its process at timeout_s and scores the fallback; the batch's other calls,
    on the other processes, score normally meanwhile; a new process takes the killed one's place for the next
    batch."""
    import os
    import time

    pid_file = tmp_path / "hung_pid"
    manager = RewardManager.from_file(str(pool_file), fallback_score=-1.0, timeout_s=1.5, num_workers=3)
    manager.score(["w0", "w1", "w2"], ["x"] * 3)  # the processes started
    texts = ["a", "hang", "b", "c", "d", "e", "f"]
    extras = [{"extra_info": {"sleep": 0.3, "pid_file": str(pid_file)}}] * len(texts)
    started = time.monotonic()
    output = manager.score(texts, ["x"] * len(texts), extras)
    elapsed = time.monotonic() - started
    assert output.scores == [-1.0 if text == "hang" else _digest(text) for text in texts]
    assert output.metrics["reward/timeouts"] == 1.0 and output.fallback_rows == [1]
    assert "timed out after 1.5 s" in output.details[1]["fallback"] and "its process was stopped" in \
        output.details[1]["fallback"]
    hung = int(pid_file.read_text())
    assert hung not in {detail.get("pid") for detail in output.details}  # the others ran beside it, elsewhere
    assert elapsed < 1.5 + 3.0, elapsed  # the deadline; the others' 1.8 s of calls shared by two processes
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)  # killed, not left sleeping
    following = manager.score(["g", "h", "i", "j"], ["x"] * 4, [{"extra_info": {"sleep": 0.3}}] * 4)
    assert following.scores == [_digest(text) for text in "ghij"] and following.metrics["reward/timeouts"] == 0.0
    assert len(manager.isolated.pids) == 3 and hung not in manager.isolated.pids  # a new one in its place
    manager.close()


def test_a_call_that_ends_its_process_fails_only_its_sample(pool_file: Path) -> None:
    manager = RewardManager.from_file(str(pool_file), fallback_score=-1.0, timeout_s=30.0, num_workers=2)
    texts = ["a", "exit", "b", "c", "d"]
    output = manager.score(texts, ["x"] * len(texts))
    assert output.scores == [-1.0 if text == "exit" else _digest(text) for text in texts]
    assert output.fallback_rows == [1] and output.details[1]["fallback"] == "ended its process (exit code 3)"
    assert output.metrics["reward/timeouts"] == 0.0
    stop = RewardManager.from_file(str(pool_file), timeout_s=30.0, num_workers=2)
    with pytest.raises(RewardFunctionError, match=r"ended its process \(exit code 3\) on sample 2"):
        stop.score(["a", "b", "exit"], ["x"] * 3)
    manager.close()
    stop.close()


def test_an_async_function_awaits_its_share_of_the_batch_in_each_process(pool_file: Path) -> None:
    """With num_workers an async def function's batch is split into contiguous shares, each awaited together in its
    process: 6 calls of a 1 s judge on 3 processes take about 1 s (each share's two at once); a call that blocks its
    event loop times out alone, its share's other call answered when the share runs again one at a time."""
    import time

    manager = RewardManager.from_file(str(pool_file), "judge", fallback_score=-1.0, timeout_s=2.0, num_workers=3)
    manager.score(["w0", "w1", "w2"], ["x"] * 3)  # the processes started
    texts = [f"q{i}" for i in range(6)]
    started = time.monotonic()
    output = manager.score(texts, ["x"] * 6)
    elapsed = time.monotonic() - started
    assert output.scores == [_digest(text) for text in texts]
    pids = [detail["pid"] for detail in output.details]
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[4] == pids[5] and len(set(pids)) == 3  # the shares
    assert elapsed < 1.9, elapsed  # each share's calls one after another: 2 s
    blocked = manager.score(["a", "block", "b", "c", "d", "e"], ["x"] * 6)  # shares [a, block], [b, c], [d, e]
    assert blocked.scores == [_digest("a"), -1.0, *map(_digest, "bcde")]
    assert blocked.metrics["reward/timeouts"] == 1.0 and "its process was stopped" in blocked.details[1]["fallback"]
    manager.close()


BUSY_REWARD = '''
import os, time

def compute_score(response, ground_truth, extra):
    open(os.path.join(extra["extra_info"]["folder"], str(os.getpid())), "w").close()  # busy now
    time.sleep(600)
    return 1.0
'''

TRAINER = '''
import sys
sys.path.insert(0, sys.argv[1])
from hybridrl.rewards.isolation import IsolatedScorer, ScorerRecipe
scorer = IsolatedScorer(ScorerRecipe(path=sys.argv[2]), timeout_s=300.0, num_workers=3)
scorer.call_each(["a", "b", "c"], ["x"] * 3, [{"extra_info": {"folder": sys.argv[3]}}] * 3)
'''


def _alive(pid: int) -> bool:
    """Running (a zombie no one has reaped yet is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_the_reward_processes_die_with_the_trainer(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a trainer killed by SIGKILL (no cleanup runs) takes its reward processes with it, even in
    the middle of a call (an idle one would end anyway, at the end of its pipe), not left burning a core for no
    one."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "busy.py").write_text(BUSY_REWARD)
    (tmp_path / "trainer.py").write_text(TRAINER)
    folder = tmp_path / "busy"
    folder.mkdir()
    root = str(Path(__file__).resolve().parents[2])
    trainer = subprocess.Popen([sys.executable, str(tmp_path / "trainer.py"), root, str(tmp_path / "busy.py"),
                                str(folder)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60.0
        while len(pids) < 3 and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.1)
            pids = [int(path.name) for path in folder.iterdir()]
        assert len(pids) == 3 and all(_alive(pid) for pid in pids), (pids, trainer.poll())  # each in its call
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 10.0
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        trainer.kill()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)  # what the test would leave behind when it fails
            except ProcessLookupError:
                pass
