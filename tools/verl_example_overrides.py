#!/usr/bin/env python
"""Record the overrides of verl's Megatron example scripts as test data (tests/support/verl_megatron_examples.json).

Each `examples/{grpo,ppo}_trainer/*megatron*.sh` of a verl checkout is run by bash itself, with `python3`
and `python` on PATH replaced by a recorder that writes its arguments instead of running anything: so every
shell variable, default (`${X:-8}`) and arithmetic (`$((1024 * 8))`) is expanded exactly as on a user's
machine, with HOME set to a stand-in home (`STAND_IN_HOME`; the one script that writes root's home literally is
given the same stand-in); paths under the checkout are written relative to verl's root. The
`verl.trainer.main_ppo` call's `key=value` arguments are kept, per script, with the verl commit they come from.

    python tools/verl_example_overrides.py --verl ~/src/verl --out tests/support/verl_megatron_examples.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["VERL_ARGS_OUT"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""
FOLDERS = ("examples/grpo_trainer", "examples/ppo_trainer")
# Neither is a path of the machine that records: HOME for the scripts is a fixed stand-in, so the data is the same
# wherever it is recorded; one verl script spells root's home out instead of using $HOME (`VERL_LITERAL_HOME`).
STAND_IN_HOME = "/home/user"
VERL_LITERAL_HOME = "/root"


def record_script(script: Path, stub_dir: Path, out: Path) -> list[str]:
    """The main_ppo overrides of one script, as bash expands them."""
    out.unlink(missing_ok=True)
    env = {"HOME": STAND_IN_HOME, "VERL_ARGS_OUT": str(out), "PATH": f"{stub_dir}:/usr/bin:/bin"}
    subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=60, cwd=script.parent)
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    (argv,) = [call for call in calls if "verl.trainer.main_ppo" in call]
    # a script that names files by $(pwd) would carry this machine's checkout path: keep them relative to verl's root.
    # One writes root's home literally: the same home directory as $HOME, so it gets HOME's stand-in.
    root = f"{script.parents[2].resolve()}/"
    return [arg.replace(root, "").replace(f"={VERL_LITERAL_HOME}/", f"={STAND_IN_HOME}/") for arg in argv
            if "=" in arg and not arg.startswith("--")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl", required=True, type=Path, help="a verl git checkout")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "-C", str(args.verl), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    scripts = sorted(p for folder in FOLDERS for p in (args.verl / folder).glob("*megatron*.sh"))
    with tempfile.TemporaryDirectory() as tmp:
        stub_dir = Path(tmp)
        for name in ("python3", "python"):
            (stub_dir / name).write_text(RECORDER.format(python=sys.executable))
            os.chmod(stub_dir / name, 0o755)
        examples = {str(s.relative_to(args.verl)): record_script(s, stub_dir, stub_dir / "args.jsonl") for s in scripts}
    data = {"source": {"repository": "https://github.com/volcengine/verl", "commit": commit,
                       "how": "tools/verl_example_overrides.py"}, "scripts": examples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {sum(map(len, examples.values()))} overrides of {len(examples)} scripts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
