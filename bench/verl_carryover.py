#!/usr/bin/env python
"""How many of verl's own Megatron example overrides hybridrl takes unchanged, and how it refuses the rest.

The overrides of every `examples/{grpo,ppo}_trainer/*megatron*.sh` script of a recent verl commit
(tests/support/verl_megatron_examples.json, recorded by tools/verl_example_overrides.py) are planned as
`hybridrl plan --layout-only` plans them (no model folder or data here). Each override is:

* accepted: no problem names its key;
* refused: a problem names its key (or the section it sits in), with the reason;

and a problem about nothing the script wrote would be a loader bug (counted as `unnamed`, must be 0).
Issue 39's target: >= 95 % accepted, every other one refused naming its key.

    python bench/verl_carryover.py   # per script, the refused keys; writes bench/results/verl_carryover.json
"""
from __future__ import annotations

import collections
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "support" / "verl_megatron_examples.json"
RESULT = ROOT / "bench" / "results" / "verl_carryover.json"
TARGET = 0.95


@dataclass
class ScriptResult:
    script: str
    overrides: int
    refused: dict[str, str] = field(default_factory=dict)  # override -> the rule that refuses it
    unnamed: list[str] = field(default_factory=list)  # problems naming no key the script wrote

    @property
    def accepted(self) -> int:
        return self.overrides - len(self.refused)


def _names(field_name: str, key: str) -> bool:
    """Whether a problem's field names `key` (its dotted path, or a section above it, or a field under it)."""
    from hybridrl.config.loader import canonical_path
    from hybridrl.config.verl_keys import verl_key

    parts = tuple(key.split("."))
    found = verl_key(parts)
    aliased = found[1] if found is not None and found[1] is not None else parts  # a verl alias sets its target
    spellings = {key, ".".join(canonical_path(parts)), ".".join(canonical_path(aliased))}
    return any(field_name == s or s.startswith(field_name + ".") or field_name.startswith((s + ".", s + "["))
               for s in spellings)


def plan_script(script: str, overrides: list[str]) -> ScriptResult:
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.loader import load_config_collecting
    from hybridrl.config.plan import build_plan

    config, issues = load_config_collecting(None, overrides)
    try:
        build_plan(config, prior_issues=issues)
        problems = list(issues)
    except ConfigError as error:
        problems = error.issues
    result = ScriptResult(script, len(overrides))
    named = set()
    for override in overrides:
        key = override.split("=", 1)[0].strip().lstrip("+")
        hits = [p for p in problems if _names(p.field, key)]
        if hits:
            result.refused[override] = hits[0].rule
            named.update(id(p) for p in hits)
    result.unnamed = [str(p) for p in problems if id(p) not in named]
    return result


def carryover(data: dict | None = None) -> list[ScriptResult]:
    data = data or json.loads(DATA.read_text())
    return [plan_script(script, overrides) for script, overrides in data["scripts"].items()]


def main() -> int:
    data = json.loads(DATA.read_text())
    results = carryover(data)
    total = sum(r.overrides for r in results)
    accepted = sum(r.accepted for r in results)
    print(f"verl {data['source']['commit'][:12]}: {len(results)} Megatron example scripts, {total} overrides")
    for r in results:
        print(f"  {r.accepted:>4}/{r.overrides:<4} {r.script}")
    refused = collections.Counter(o.split("=", 1)[0].lstrip("+") for r in results for o in r.refused)
    print("refused keys (count):")
    for key, count in refused.most_common():
        print(f"  {count:>3} {key}")
    unnamed = [u for r in results for u in r.unnamed]
    share = accepted / total
    print(f"accepted {accepted} of {total} = {share:.1%} (target {TARGET:.0%}); refused without naming the key: "
          f"{len(unnamed)}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "verl_commit": data["source"]["commit"], "scripts": len(results), "overrides": total, "accepted": accepted,
        "accepted_share": round(share, 4), "target": TARGET, "unnamed_refusals": len(unnamed),
        "refused_keys": dict(refused.most_common()),
        "per_script": {r.script: {"accepted": r.accepted, "overrides": r.overrides} for r in results},
    }, indent=1) + "\n")
    print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
