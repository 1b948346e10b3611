"""The torch-free name module, the lazy package API, and their agreement with the implementations."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridrl.algorithms as algorithms
from hybridrl.algorithms import names
from hybridrl.algorithms.registry import ADV_ESTIMATORS, compute_advantages


def test_names_module_imports_without_torch():
    code = (
        "import sys, hybridrl.algorithms.names as n; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert 'gae' in n.ADV_ESTIMATOR_NAMES"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_registry_agrees_with_names():
    assert sorted(ADV_ESTIMATORS) == sorted(names.ADV_ESTIMATOR_NAMES)
    for subset in (names.CRITIC_ADV_ESTIMATORS, names.GROUP_ADV_ESTIMATORS, names.GREEDY_BASELINE_ADV_ESTIMATORS):
        assert set(subset) <= set(names.ADV_ESTIMATOR_NAMES)
    assert set(names.KL_PENALTY_ALIASES.values()) <= set(names.KL_PENALTY_KINDS)


@pytest.mark.parametrize("name", names.ADV_ESTIMATOR_NAMES)
def test_estimator_requirements_match_the_name_groups(name):
    """An estimator fails without exactly the inputs its name group says it needs."""
    rewards, mask = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.ones(2, 2)
    full = {"values": torch.zeros(2, 2), "group_index": [0, 0], "baseline_scores": torch.zeros(2)}
    needs = {
        "values": name in names.CRITIC_ADV_ESTIMATORS,
        "group_index": name in names.GROUP_ADV_ESTIMATORS,
        "baseline_scores": name in names.GREEDY_BASELINE_ADV_ESTIMATORS,
    }
    advantages, returns = compute_advantages(name, rewards, mask, **full)
    assert advantages.shape == returns.shape == (2, 2)
    for field, needed in needs.items():
        partial = {key: value for key, value in full.items() if key != field}
        if needed:
            with pytest.raises(ValueError, match=f"needs {field}"):
                compute_advantages(name, rewards, mask, **partial)
        else:
            compute_advantages(name, rewards, mask, **partial)


def test_lazy_public_api_resolves_every_name():
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None
    assert set(dir(algorithms)) >= set(algorithms.__all__)
    with pytest.raises(AttributeError):
        algorithms.no_such_function  # noqa: B018


def test_type_checking_imports_match_the_lazy_table():
    """The `if TYPE_CHECKING:` re-exports (what static analysers see) name the same modules as `_EXPORTS`."""
    tree = ast.parse(Path(algorithms.__file__).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING")
    static = {alias.name: node.module.rsplit(".", 1)[1] for node in block.body for alias in node.names}
    assert static == algorithms._EXPORTS


def test_unknown_name_message():
    message = names.unknown_name_message("loss aggregation mode", "seq-mean", names.LOSS_AGG_MODES)
    assert message.startswith("unknown loss aggregation mode 'seq-mean'")
    assert "did you mean" in message and "token-sum" in message
    assert "did you mean" not in names.unknown_name_message("thing", "zzzz", ("a", "b"))
