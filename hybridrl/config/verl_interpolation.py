"""Interpolations in a YAML file (`${oc.select:a.b,default}`, `${..x}`), resolved as verl's Hydra resolves them.

A whole verl config (verl's generated trainer YAML, or the `.hydra/config.yaml` a verl run saves) derives many keys
from others: the reference's layout from the actor's, the critic's batch sizes from the actor's. verl resolves them
with OmegaConf after Hydra has applied the command line's overrides, so an override of the actor's value reaches
every key that names it. The same is done here, with OmegaConf itself (the version verl's hydra-core pins): only
for a file that has interpolations (a plain hybridrl YAML is read exactly as before), and each key that does not
resolve is a problem naming the key and its expression, never a traceback.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hybridrl.config.errors import CONFIG_FILE, ConfigIssue

MARK = "${"


def has_interpolation(tree: Any) -> bool:
    """Whether any string in a loaded YAML tree is (or holds) an interpolation."""
    if isinstance(tree, dict):
        return any(has_interpolation(value) for value in tree.values())
    if isinstance(tree, list):
        return any(has_interpolation(value) for value in tree)
    return isinstance(tree, str) and MARK in tree


def _interpolated(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each key whose value holds an interpolation (a list: the list's key), with the value as written."""
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict):
            yield from _interpolated(value, path)
        elif has_interpolation(value):
            yield path, value


class InterpolatedConfig:
    """A loaded YAML tree as OmegaConf sees it, the command line's overrides of keys the file has applied first (as
    Hydra applies a verl command line before verl resolves its config). Built on first use: a file without
    interpolations never imports OmegaConf."""

    def __init__(self, tree: dict[str, Any], overrides: Iterable[tuple[tuple[str, ...], Any]] = ()) -> None:
        self.tree = tree
        # Hydra's override of an existing key; the others (hybridrl's own spellings) are the loader's business
        self._overrides = [(parts, value) for parts, value in overrides if _lookup(tree, parts) is not _ABSENT]
        self._config: Any = None

    def _omegaconf(self) -> Any:
        from omegaconf import OmegaConf

        if self._config is None:
            self._config = OmegaConf.create(self.tree)
            for parts, value in self._overrides:
                OmegaConf.update(self._config, ".".join(parts), value, merge=False)
        return self._config

    def _select(self, key: str) -> Any:
        from omegaconf import OmegaConf

        node = OmegaConf.select(self._omegaconf(), key, throw_on_resolution_failure=True)
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    def resolved(self, issues: list[ConfigIssue]) -> dict[str, Any]:
        """The tree with each interpolation replaced by its value. A key that does not resolve is left out, with a
        problem naming it and its expression."""
        resolved = _copy(self.tree)
        try:
            self._omegaconf()
        except ImportError as exc:  # an install without hybridrl's requirements
            issues.append(ConfigIssue(CONFIG_FILE, str(exc), "has interpolations (${...}), which need the omegaconf "
                                      "package: pip install 'omegaconf>=2.3,<2.4' (hybridrl's install requires it)"))
            return resolved
        except Exception as exc:  # noqa: BLE001 - a tree OmegaConf cannot hold (a key that is not a string...)
            issues.append(ConfigIssue(CONFIG_FILE, str(exc).splitlines()[0], "has interpolations (${...}) but "
                                      "OmegaConf cannot read it to resolve them"))
            return resolved
        for parts, written in _interpolated(self.tree):
            try:
                value = self._select(".".join(parts))
            except Exception as exc:  # noqa: BLE001 - OmegaConf's errors share no base worth naming here
                message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                issues.append(ConfigIssue(".".join(parts), written, f"is an interpolation that does not resolve "
                                          f"({message}): name a key the file has, or write the value itself"))
                _remove(resolved, parts)
                continue
            _put(resolved, parts, value)
        return resolved

    def written(self, parts: tuple[str, ...]) -> Any:
        """The file's value of a key as written (an interpolation unresolved); None where the file lacks it."""
        value = _lookup(self.tree, parts)
        return None if value is _ABSENT else value

    def evaluate(self, parts: tuple[str, ...], expression: str) -> Any:
        """What `expression` (an interpolation) would give at `parts` in this config; raises when it does not
        resolve. The key's own value is put back after (a key the file lacks: the config is rebuilt on next use)."""
        from omegaconf import OmegaConf

        config, key = self._omegaconf(), ".".join(parts)
        written = _lookup(self.tree, parts)
        for override, value in self._overrides:
            if override == parts:
                written = value
        OmegaConf.update(config, key, expression, merge=False, force_add=True)
        try:
            return self._select(key)
        finally:
            if written is _ABSENT:
                self._config = None
            else:
                OmegaConf.update(config, key, written, merge=False)


_ABSENT = object()


def _lookup(tree: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copy(value) for value in tree]
    return tree


def _put(tree: dict[str, Any], parts: tuple[str, ...], value: Any) -> None:
    for part in parts[:-1]:
        tree = tree[part]
    tree[parts[-1]] = value


def _remove(tree: dict[str, Any], parts: tuple[str, ...]) -> None:
    for part in parts[:-1]:
        tree = tree[part]
    del tree[parts[-1]]
