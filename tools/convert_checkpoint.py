#!/usr/bin/env python
"""Convert checkpoints between HF and hybridrl's sharded megatron layout.

Same as `hybridrl convert ...`, for users who expect a script in tools/:
    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2
"""
import sys

from hybridrl.models.convert_cli import main

if __name__ == "__main__":
    sys.exit(main())
