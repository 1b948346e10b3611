#!/usr/bin/env python
"""A small student for on-policy distillation from a real model: the teacher's architecture at a few of its layers.

    python tools/make_distill_student.py      # data/models/smollm2-135m-instruct -> data/models/smollm2-student
    python tools/make_distill_student.py --teacher DIR --layers 4 --out DIR [--random-layers]

The student is a `LlamaForCausalLM` of the teacher's config with `--layers` decoder layers. It takes the
teacher's token embeddings (tied to the output layer, as SmolLM2's are), its final norm and, unless
`--random-layers`, `--layers` of its decoder layers spread evenly from the first to the last (layer dropping, the
usual start of a pruned student: the first and last layers read and write the embedding space); the tokenizer
and chat template are the teacher's files, byte for byte, so `hybridrl plan` accepts the pair. A 4-layer student
of SmolLM2-135M-Instruct has 42.5M parameters (28.3M of them the embeddings) against the teacher's 134.5M.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def chosen_layers(teacher_layers: int, student_layers: int, selection: str = "spread") -> list[int]:
    """`student_layers` of the teacher's layer indices: `spread` evenly from the first to the last, or `first`: the
    first `student_layers - 1` and the last (the later middle layers dropped)."""
    if not 1 <= student_layers <= teacher_layers:
        raise ValueError(f"--layers {student_layers} must be in [1, {teacher_layers}] (the teacher's layers)")
    if student_layers == 1:
        return [teacher_layers - 1]
    if selection == "first":
        return [*range(student_layers - 1), teacher_layers - 1]
    return [round(i * (teacher_layers - 1) / (student_layers - 1)) for i in range(student_layers)]


def make_student(teacher: Path, out: Path, layers: int, *, selection: str = "spread", copy_layers: bool = True,
                 seed: int = 0) -> list[int]:
    """Write the student to `out`; returns the teacher layers it copied (empty with random layers)."""
    import torch
    import transformers

    fields = json.loads((teacher / "config.json").read_text())
    config = transformers.AutoConfig.from_pretrained(teacher)
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    student = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    chosen = chosen_layers(fields["num_hidden_layers"], layers, selection) if copy_layers else []
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        student.model.norm.weight.copy_(source.model.norm.weight)
        if not config.tie_word_embeddings:
            student.lm_head.weight.copy_(source.lm_head.weight)
        for mine, theirs in enumerate(chosen):
            student.model.layers[mine].load_state_dict(source.model.layers[theirs].state_dict())
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out)
    for name in COPIED_FILES:
        if (teacher / name).is_file():
            shutil.copyfile(teacher / name, out / name)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, default=ROOT / "data/models/smollm2-135m-instruct")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "data/models/smollm2-student")
    parser.add_argument("--select", choices=("spread", "first"), default="spread",
                        help="which teacher layers: spread evenly, or the first layers-1 and the last")
    parser.add_argument("--random-layers", action="store_true", help="random decoder layers (embeddings copied)")
    args = parser.parse_args()
    chosen = make_student(args.teacher, args.out, args.layers, selection=args.select,
                          copy_layers=not args.random_layers)
    print(f"student written to {args.out}: {args.layers} layers" +
          (f" from the teacher's {chosen}" if chosen else " (random), the teacher's embeddings"))


if __name__ == "__main__":
    main()
