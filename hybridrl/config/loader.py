"""YAML + dotted command-line overrides -> a type-checked `JobConfig`.

All problems are collected before anything is raised, so a user fixes a config in one pass:
unknown keys (with a did-you-mean), wrong types, malformed overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hybridrl.config.errors import CONFIG_FILE, ConfigError, ConfigIssue, show_value
from hybridrl.config.schema import REF_DEFAULTS_TO_ACTOR, REF_SHARES_WITH_ACTOR, JobConfig, MegatronConfig, without_none
from hybridrl.config.verl_default_values import VERL_DEFAULTS
from hybridrl.config.verl_defaults import MISSING, TARGET, VerlDefaults, missing_refusal, refusal, target_refusal
from hybridrl.config.verl_interpolation import InterpolatedConfig, has_interpolation
from hybridrl.config.verl_keys import Alias, Implies, Refused, Restates, restated, verl_key
from hybridrl.config.yaml_load import RepeatedKeyError, load_yaml

# Fields users of other trainers write directly on a role: accepted there and moved into the
# role's `megatron` section, so `actor_rollout_ref.actor.tensor_model_parallel_size=2` works too.
_MEGATRON_FIELDS = frozenset(f.name for f in dataclasses.fields(MegatronConfig))
COMMAND_LINE = "the command line"


def _role_sections(cls: type = JobConfig, prefix: tuple[str, ...] = ()) -> frozenset[tuple[str, ...]]:
    """Paths of the sections that carry a `megatron` layout (the roles), read off the schema."""
    found: set[tuple[str, ...]] = set()
    names = {f.name for f in dataclasses.fields(cls)}
    if "megatron" in names and prefix:
        found.add(prefix)
    for name, hint in typing.get_type_hints(cls).items():
        section = _section_type(hint)
        if section is not None and name != "megatron":
            found |= _role_sections(section, (*prefix, name))
    return frozenset(found)


def _section_type(hint: Any) -> type | None:
    hint = without_none(hint)
    return hint if dataclasses.is_dataclass(hint) else None


ROLE_SECTIONS = _role_sections()


def megatron_field_aliases() -> dict[str, str]:
    """Every field accepted under two spellings: the role-level path -> the `.megatron.` path."""
    return {
        ".".join((*role, name)): ".".join((*role, "megatron", name))
        for role in sorted(ROLE_SECTIONS) for name in sorted(_MEGATRON_FIELDS)
    }


def canonical_path(parts: tuple[str, ...]) -> tuple[str, ...]:
    """The one spelling of a dotted path: a role-level megatron field moves into `megatron`."""
    for depth in range(1, len(parts)):
        if parts[:depth] in ROLE_SECTIONS and parts[depth] in _MEGATRON_FIELDS:
            return (*parts[:depth], "megatron", *parts[depth:])
    return parts


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Read a YAML job config (or start from defaults) and apply `a.b.c=value` overrides."""
    config, issues = load_config_collecting(path, overrides)
    if issues:
        raise ConfigError(issues)
    return config


def load_config_collecting(
    path: str | Path | None = None, overrides: Iterable[str] = (), verl: VerlDefaults | None = None
) -> tuple[JobConfig, list[ConfigIssue]]:
    """Like `load_config`, but return the problems instead of raising.

    Unknown keys and ill-typed values are reported and left at their defaults, so the caller can
    go on validating the rest and report everything in one pass. `verl` (given by the plan) collects the verl
    keys taken at verl's defaults (`hybridrl.config.verl_defaults`).
    """
    issues: list[ConfigIssue] = []
    raw: dict[str, Any] = {}
    implied: _Implied = {}
    verl = verl if verl is not None else VerlDefaults()
    assignments = []
    for override in overrides:
        parsed = _parse_override(override, issues)
        if parsed is not None:
            assignments.extend(parsed)
    if path is not None:
        tree = _read_yaml(Path(path), issues)
        # a whole verl config derives keys from others: resolved as verl's Hydra does, after the command line's
        # overrides of the keys the file has (in either spelling); a file without interpolations is read as it is
        verl.context = InterpolatedConfig(tree, [(spelling, _plain(value)) for parts, value in assignments
                                                 for spelling in dict.fromkeys((parts, canonical_path(parts)))])
        verl.file_context = InterpolatedConfig(tree)
        read = verl.context.resolved(issues) if has_interpolation(tree) else tree
        # a key the command line sets is the command line's alone, as in Hydra: the file's value is never read (a
        # verl file's critic.strategy=fsdp, replaced on the line, is not refused)
        overridden = {canonical_path(parts) for parts, _ in assignments}
        file_leaves = [(parts, value) for parts, value in _leaves(read) if canonical_path(parts) not in overridden]
        _merge_source(raw, file_leaves, str(path), issues, implied, verl, from_file=True)
    _merge_source(raw, assignments, COMMAND_LINE, issues, implied, verl)
    _check_missing(raw, verl.missing, issues)
    _apply_implied(raw, implied, issues)
    _inherit_reference_layout(raw)
    return _build(JobConfig, raw, "", issues), issues


def _check_missing(raw: dict[str, Any], missing: list[tuple[str, ...]], issues: list[ConfigIssue]) -> None:
    """Each of verl's mandatory values (`???`) the file leaves unset and no later source sets is a problem."""
    for parts in missing:
        node: Any = raw
        for part in canonical_path(parts):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            issues.append(ConfigIssue(".".join(parts), MISSING, missing_refusal()))


# per verl key that implies fields (`verl_keys.Implies`), the fields its last value sets: a later source's value
# replaces an earlier one's, as for any key
_Implied = dict[tuple[str, ...], dict[str, Any]]


def _apply_implied(raw: dict[str, Any], implied: _Implied, issues: list[ConfigIssue]) -> None:
    """Set the fields a verl key's value implies (reward_manager=prime: num_workers) where no source set them: the
    job's own value of a field wins over what a verl key implies for it."""
    for fields in implied.values():
        for name, value in fields.items():
            parts = canonical_path(tuple(name.split(".")))
            node: Any = raw
            for part in parts:
                if _plain(node) is None or (isinstance(node, dict) and part not in node):
                    _assign(raw, parts, value, issues)  # no source set it (a null section is its defaults)
                    break
                if not isinstance(node, dict):
                    break  # a value where a section belongs: the schema's refusal
                node = node[part]


def _inherit_reference_layout(raw: dict[str, Any]) -> None:
    """A `ref.megatron` section (written for its offload, say) takes the actor's layout fields it does not
    set itself, as verl's config interpolates them: the two must be equal (`REF_SHARES_WITH_ACTOR`); and the
    actor's dtype, sequence parallelism and megatron overrides where it does not set its own
    (`REF_DEFAULTS_TO_ACTOR`)."""
    arr = raw.get("actor_rollout_ref")
    if not isinstance(arr, dict):
        return
    ref, actor = (arr.get(role) if isinstance(arr.get(role), dict) else {} for role in ("ref", "actor"))
    ref_layout, actor_layout = ref.get("megatron"), actor.get("megatron")
    if isinstance(ref_layout, dict) and isinstance(actor_layout, dict):
        for name in (*REF_SHARES_WITH_ACTOR, *REF_DEFAULTS_TO_ACTOR):
            if name in actor_layout and name not in ref_layout:
                ref_layout[name] = actor_layout[name]


def config_from_dict(raw: Mapping[str, Any]) -> JobConfig:
    """Build a `JobConfig` from a plain nested dict (e.g. `config_to_dict` output)."""
    issues: list[ConfigIssue] = []
    tree: dict[str, Any] = {}
    implied: _Implied = {}
    _merge_source(tree, _leaves(dict(raw)), "the given dict", issues, implied)
    _apply_implied(tree, implied, issues)
    config = _build(JobConfig, tree, "", issues)
    if issues:
        raise ConfigError(issues)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain nested dict (YAML/JSON-ready) of any config dataclass."""
    return dataclasses.asdict(config)


def config_and_overrides(first: str | None, rest: list[str]) -> tuple[str | None, list[str]]:
    """A command line's job: its YAML config (None: the defaults) and its overrides. A first argument that is an
    override (`a.b=c`, not a .yaml path) starts the overrides, as verl's scripts give every setting on the line."""
    if first and "=" in first and not first.endswith((".yaml", ".yml")):
        return None, [first, *rest]
    return first, list(rest)


def _read_yaml(path: Path, issues: list[ConfigIssue]) -> dict[str, Any]:
    if path.is_dir():
        issues.append(ConfigIssue(CONFIG_FILE, str(path), "is a folder: give a YAML file (configs/examples/ has some)"))
        return {}
    if not path.is_file():
        issues.append(ConfigIssue(CONFIG_FILE, str(path), "file not found"))
        return {}
    try:
        with path.open(encoding="utf-8") as stream:  # read as a stream: YAML's errors then name the file
            loaded = load_yaml(stream)
    except UnicodeDecodeError as exc:
        issues.append(ConfigIssue(CONFIG_FILE, str(path), f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                                  f"offset {exc.start}): save the file as UTF-8"))
        return {}
    except yaml.YAMLError as exc:
        issues.append(ConfigIssue(CONFIG_FILE, str(path), f"not valid YAML: {exc}"))
        return {}
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        issues.append(ConfigIssue(CONFIG_FILE, str(path), "top level must be a mapping of sections"))
        return {}
    return loaded


def _parse_override(override: str, issues: list[ConfigIssue]) -> list[tuple[tuple[str, ...], Any]] | None:
    """`a.b.c=value` as leaf assignments (a mapping value sets each of its fields, merging)."""
    key, sep, text = override.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        issues.append(ConfigIssue("<override>", override, "expected the form section.field=value"))
        return None
    try:
        value = load_yaml(text) if text.strip() else ""
    except RepeatedKeyError as exc:
        issues.append(ConfigIssue("<override>", override, f"not valid YAML: {exc}"))
        return None
    except yaml.YAMLError as exc:
        stripped = text.strip()
        if stripped[:1] in ("{", "[") and stripped[-1:] != {"{": "}", "[": "]"}[stripped[0]]:
            # a mapping or list cut short: applied as a string, it would replace a whole section with text and
            # drop what the file set there (a closed one that is not YAML, `[*.layers.0.*]`, stays text)
            problem = str(exc).splitlines()[0]
            issues.append(ConfigIssue(key, text, f"is not a valid YAML mapping or list ({problem}): close its "
                                      "brackets and quote values with commas or colons"))
            return None
        value = text  # not YAML: take it as a plain string, the type check decides
    parts = tuple(key.split("."))
    if isinstance(value, dict):
        return list(_leaves(value, parts))
    # Overrides are typed as YAML; keep the user's raw text for string fields (e.g. a path "007").
    return [(parts, _RawOverride(value, text))]


def override_fields(override: str) -> list[tuple[str, Any]]:
    """The fields a command-line override sets, as the loader applies it: (canonical dotted path, value) for each
    (a mapping override: each field under it; a verl key: hybridrl's field). [] for one the loader would refuse or
    take as restating hybridrl's behaviour, and for a verl key that only implies fields where the job sets none
    (`verl_keys.Implies`: reward_manager=prime)."""
    issues: list[ConfigIssue] = []
    fields = []
    for parts, value in _parse_override(override, issues) or []:
        verl = _read_verl_key(parts, value, issues)
        if verl is not None:
            fields.append((".".join(canonical_path(verl[0])), _plain(verl[1])))
    return fields


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> typing.Iterator[tuple[tuple[str, ...], Any]]:
    """Every (path, value) a nested mapping sets; an empty mapping sets its section to defaults."""
    if isinstance(tree, dict) and (tree or not prefix):
        for key, value in tree.items():
            yield from _leaves(value, (*prefix, str(key)))
    else:
        yield prefix, tree


def _merge_source(raw: dict[str, Any], assignments: Iterable[tuple[tuple[str, ...], Any]], source: str,
                  issues: list[ConfigIssue], implied: _Implied, verl: VerlDefaults | None = None,
                  from_file: bool = False) -> None:
    """Write one source's assignments (the file, or the command line) into `raw`, each at its
    canonical path, so a later source replaces an earlier one whichever spelling either used.
    Within the source the same path written twice keeps the last value; two spellings of one
    field with different values are an error naming both, unless one is a verl spelling at verl's default (verl's
    whole config writes both of a pair, `model.lora_alpha` of its FSDP trainer beside `model.lora.alpha`; the one
    at its default is the one not in use): the other wins. What a verl key implies goes to `implied`,
    set once every source is read (`_apply_implied`). `from_file`: the source is the YAML file (a key that follows
    another by verl's own interpolation there is at verl's default)."""
    written: dict[tuple[str, ...], tuple[str, Any, tuple[bool, bool]]] = {}
    for parts, value in assignments:
        spelling = ".".join(parts)  # as written: a verl alias and its target are two spellings of one field
        verl_default = verl is not None and verl.matches(parts, _plain(value), from_file)
        read = _read_verl_key(parts, value, issues, implied, verl, verl_default, from_file)
        if read is None:
            continue
        parts, value = read
        where = canonical_path(parts)
        # which of two spellings gives way: one at verl's default, and of two such a null (verl's "not set")
        rank = (verl_default, verl_default and _plain(value) is None)
        earlier = written.get(where)
        if earlier is not None and earlier[0] != spelling and _plain(earlier[1]) != _plain(value):
            if rank > earlier[2]:
                continue
            if rank == earlier[2]:
                issues.append(ConfigIssue(
                    earlier[0], _plain(earlier[1]),
                    f"conflicts with {spelling}={show_value(_plain(value))} in {source} (two spellings of one "
                    "field); write it once, or give both the same value"))
                continue
        if _plain(value) is None and any(len(path) > len(where) and path[: len(where)] == where for path in written):
            continue  # `section: null` beside fields of that section in one source: the fields win
        written[where] = (spelling, value, rank)
        _assign(raw, where, value, issues)


def _read_verl_key(parts: tuple[str, ...], value: Any, issues: list[ConfigIssue],
                   implied: _Implied | None = None, verl: VerlDefaults | None = None, verl_default: bool = False,
                   from_file: bool = False) -> tuple[tuple[str, ...], Any] | None:
    """A verl key without a field of hybridrl's own, in verl's meaning (`hybridrl.config.verl_keys`): the
    (path, value) to assign, or None when it is taken as restating hybridrl's behaviour or verl's default
    (`verl_default`, found by `verl`: `hybridrl.config.verl_defaults`), implies fields (kept in `implied`) or is
    refused."""
    spelling, plain = ".".join(parts), _plain(value)
    found = verl_key(parts)
    if verl is not None:
        if parts[-1] == TARGET:  # Hydra's class of the section
            if verl.target_known(parts, plain, from_file):
                verl.targets.append(spelling)
            else:
                issues.append(ConfigIssue(spelling, _as_written(value), target_refusal(verl.default_of(parts))))
            return None
        if not (found is not None and isinstance(found[0], Alias)):  # an alias is hybridrl's field: its value holds
            if verl_default or verl.unset(parts, plain, from_file):
                verl.taken.append(spelling)
                return None
            if found is None and spelling in VERL_DEFAULTS:  # verl's key, not at verl's default: the user's setting
                issues.append(ConfigIssue(spelling, _as_written(value), refusal(parts)))
                return None
        if plain == MISSING:  # verl's mandatory value: a later source must give it (`_check_missing`)
            verl.missing.append(parts)
            return None
    if found is None:
        return parts, value
    entry, target = found
    if isinstance(entry, Implies):
        fields = entry.implied(plain)
        if fields is None:
            issues.append(ConfigIssue(spelling, _as_written(value), entry.reason(plain)))
        elif implied is not None:
            implied[parts] = fields
        return None
    if isinstance(entry, Refused):
        if plain is None and entry.null_restates:
            return None
        issues.append(ConfigIssue(spelling, _as_written(value), entry.reason(plain)))
        return None
    if isinstance(entry, Restates):
        if not restated(entry, plain):
            accepted = ", ".join(show_value(v) for v in entry.accepted)  # type: ignore[union-attr]
            issues.append(ConfigIssue(spelling, _as_written(value), f"is a verl setting hybridrl takes only as "
                                                                    f"{accepted}: {entry.does}"))
        return None
    if entry.translate and (plain is None or isinstance(plain, (str, int, float))) and plain in entry.translate:
        value = entry.translate[plain]  # verl's value as hybridrl's (rollout.mode async -> colocated)
    assert target is not None  # an Alias has one
    return target, value


def _assign(raw: dict[str, Any], parts: tuple[str, ...], value: Any, issues: list[ConfigIssue]) -> None:
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or _plain(child) is None:
            child = node[part] = {}  # null section = defaults: the fields written under it fill it
        if not isinstance(child, dict):
            issues.append(ConfigIssue(".".join(parts[: depth + 1]), _plain(child),
                                      f"is a value, not a section: {'.'.join(parts)} names a field it does not "
                                      "have (a mapping given to it sets fields under it)"))
            return
        node = child
    last = parts[-1]
    if isinstance(_plain(value), dict):  # an empty mapping: the section exists, fields keep what they have
        if not isinstance(node.get(last), dict):
            node[last] = {}
        return
    node[last] = value


_INVALID = object()  # a value that failed its type check: the field keeps its default


@dataclasses.dataclass(frozen=True)
class _RawOverride:
    value: Any
    text: str


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, prefix: str, issues: list[ConfigIssue]) -> Any:
    if isinstance(raw, _RawOverride):
        raw = raw.value
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(prefix or "<config>", raw, "must be a section (a mapping)"))
        return cls()
    raw = dict(raw)
    names = [f.name for f in dataclasses.fields(cls)]
    # a role also accepts its layout's fields (moved into `megatron` before building)
    candidates = [*names, *sorted(_MEGATRON_FIELDS)] if "megatron" in names else names
    for key in raw:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            issues.append(ConfigIssue(where, _as_written(raw[key]), f"unknown key{hint}"))
    hints = _hints(cls)
    values = {}
    for name in names:
        if name in raw:
            where = f"{prefix}.{name}" if prefix else name
            value = _coerce(hints[name], raw[name], where, issues)
            if value is not _INVALID:
                values[name] = value
    return cls(**values)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, _RawOverride) else value


def _as_written(value: Any) -> Any:
    """A value as a problem reports it: what the user wrote, nested sections included (an unknown section's
    fields are overrides still wrapped for their raw text, which no message or JSON report may show)."""
    if isinstance(value, dict):
        return {key: _as_written(item) for key, item in value.items()}
    return _plain(value)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str, issues: list[ConfigIssue]) -> Any:
    raw_text = value.text if isinstance(value, _RawOverride) else None
    value = _plain(value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        inner = options[0] if len(options) == 1 else tp
        return _coerce(inner, _RawOverride(value, raw_text) if raw_text is not None else value, where, issues)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, issues)
    if origin is typing.Literal:  # read as its values' type; validation names the valid values
        (kind,) = {type(choice) for choice in typing.get_args(tp)}
        return _coerce(kind, _RawOverride(value, raw_text) if raw_text is not None else value, where, issues)
    if origin is dict:  # a mapping handed on as written (megatron's override_transformer_config)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            issues.append(ConfigIssue(where, _as_written(value), "must be a mapping of names to values"))
            return _INVALID
        return {str(key): _as_written(item) for key, item in value.items()}
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single path for a list-of-paths field is what users mean
        if not isinstance(value, list):
            issues.append(ConfigIssue(where, _as_written(value), f"must be a list of {_type_name(item_type)}"))
            return _INVALID
        items = [_coerce(item_type, item, f"{where}[{i}]", issues) for i, item in enumerate(value)]
        return _INVALID if any(item is _INVALID for item in items) else items
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if raw_text is not None:
            return raw_text.strip()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is typing.Any:
        return value
    issues.append(ConfigIssue(where, _as_written(value), f"must be {_type_name(tp)}, got {type(value).__name__}"))
    return _INVALID
