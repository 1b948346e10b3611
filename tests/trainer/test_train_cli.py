"""`hybridrl train`'s own command line: a user's mistake there is one clear line and exit 2, before any planning."""
from __future__ import annotations

import subprocess
import sys


def test_train_without_a_config_asks_for_it():
    done = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # argparse said "the following arguments are required: config, overrides" (the overrides are optional)
    assert done.stderr.strip() == ("hybridrl train: give the job's YAML config first (configs/examples/ has some), "
                                   "then any overrides")
