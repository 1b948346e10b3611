"""`hybridrl convert`: HF ⇄ sharded megatron checkpoints, offline, on CPU, without torch.distributed.

  hybridrl convert hf-to-mcore   --hf DIR   --out DIR --tp N --pp M [--vpp K] [--ep E] [--etp X] [--dtype bf16]
                                 [--first-stage-layers F] [--last-stage-layers L]
  hybridrl convert mcore-to-hf   --ckpt DIR --out DIR [--dtype bf16] [--max-shard-size 5GB]
  hybridrl convert mcore-to-mcore --ckpt DIR --out DIR --tp N --pp M [--vpp K] [--ep E] [--etp X]
                                 [--first-stage-layers F] [--last-stage-layers L]
  hybridrl convert gguf-to-hf    --gguf FILE --out DIR [--dtype float32|bfloat16]

A LoRA actor's checkpoint (`<role>/model` beside the `<role>/lora` PEFT adapter folder) exports with its adapters
merged into the weights (W + alpha/r B A, as peft's merge_and_unload).

Every command refuses an `--out` that is, holds or lies inside its input (`--hf`, `--ckpt`, `--gguf`: replacing it
would delete the input) before reading anything, validates its input fully before writing, checks free disk space,
writes into a staging folder next to `--out` and renames it into place at the end (`hybridrl.persistence`): on any
error `--out` is left as it was. Megatron checkpoints are verified against their sha256 sums when read.

Module-level imports stay light (argparse and torch-free hybridrl modules): torch and
`hybridrl.models.checkpoint` (which imports it) are imported inside `run`, so building the `hybridrl`
parser costs nothing.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hybridrl.models.arch import ModelShape, ParallelLayoutError, UnsupportedModelError
from hybridrl.models.gguf import GGUFError, MissingGGUFDependencyError, convert_gguf_to_hf
from hybridrl.models.layout import ParallelLayout
from hybridrl.persistence import CheckpointError, check_apart, check_output_dir

if TYPE_CHECKING:  # torch: imported where used (module docstring)
    from hybridrl.models.checkpoint import TensorReader
    from hybridrl.models.lora import PeftMerge

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 5GB, 500MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


CKPT_HELP = ("checkpoint folder written by hybridrl, or a training checkpoint's global_step_N or global_step_N/actor "
             "(the actor's model)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", required=True, help="output folder (created; must be empty unless --force)")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                       help="output dtype (default: the input's; mcore-to-hf: the model's own, as its config.json "
                            "declares it; a dtype given here becomes the one the output's config declares)")
        p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    def parallel(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size")
        p.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size")
        p.add_argument("--vpp", type=_positive, default=None, help="virtual pipeline chunks per stage")
        p.add_argument("--ep", type=_positive, default=1, help="expert-parallel size (MoE models)")
        p.add_argument("--etp", type=_positive, default=None,
                       help="expert tensor-parallel size (MoE models; default: --tp)")
        p.add_argument("--first-stage-layers", type=_positive, default=None,
                       help="uneven PP: decoder layers on the first stage (default: the even share)")
        p.add_argument("--last-stage-layers", type=_positive, default=None,
                       help="uneven PP: decoder layers on the last stage (default: the even share)")

    to_mcore = sub.add_parser("hf-to-mcore", help="HF folder -> sharded megatron checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF folder with config.json and safetensors")
    parallel(to_mcore)
    common(to_mcore)

    to_hf = sub.add_parser("mcore-to-hf", help="sharded megatron checkpoint -> HF folder")
    to_hf.add_argument("--ckpt", required=True, help=CKPT_HELP)
    to_hf.add_argument("--max-shard-size", type=parse_size, default="5GB",
                       help="largest safetensors file in the HF output (default 5GB)")
    common(to_hf)

    reshard = sub.add_parser("mcore-to-mcore", help="re-shard a megatron checkpoint to another TP/PP")
    reshard.add_argument("--ckpt", required=True, help=CKPT_HELP)
    parallel(reshard)
    common(reshard)

    from_gguf = sub.add_parser(
        "gguf-to-hf", help="GGUF file (llama.cpp) -> plain HF folder, dequantized (needs gguf, accelerate)")
    from_gguf.add_argument("--gguf", required=True, help="the .gguf file")
    from_gguf.add_argument("--out", required=True, help="output folder (created; must be empty unless --force)")
    from_gguf.add_argument("--dtype", choices=["float32", "bfloat16", "fp32", "bf16"], default="float32",
                           help="weights' dtype in the output (default float32)")
    from_gguf.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    from_gguf.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_gguf_to_hf(args: argparse.Namespace) -> int:
    from hybridrl.models.checkpoint import parse_dtype

    try:
        check_apart(args.out, {"--gguf": args.gguf}, "--out")
        check_output_dir(args.out, args.force)
        out = convert_gguf_to_hf(args.gguf, args.out, dtype=parse_dtype(args.dtype), force=args.force,
                                 progress=not args.quiet)
    except (CheckpointError, UnsupportedModelError, GGUFError, MissingGGUFDependencyError,
            FileNotFoundError) as exc:
        print(f"hybridrl convert: error: {exc}", file=sys.stderr)
        return 2  # the input is refused, as `plan` refuses a config
    print(f"hybridrl convert: wrote {out}")
    return 0


def _lora_merge(ckpt: str, shape: ModelShape) -> PeftMerge | None:
    """A LoRA actor's checkpoint (`<role>/model` beside `<role>/lora`, a PEFT adapter folder): its adapters, merged
    into the exported weights (else the export would be the frozen base alone); None without one."""
    from hybridrl.models.layout import hf_tensor_shapes
    from hybridrl.models.lora import PeftMerge

    folder = lora_folder(ckpt)
    if folder is None:
        return None
    merge = PeftMerge.read(folder)
    unknown = sorted(set(merge.weights) - set(hf_tensor_shapes(shape)))
    if unknown:
        raise CheckpointError(f"{folder}: adapters for weights the model does not have: {unknown[:3]}")
    print(f"hybridrl convert: merging the LoRA adapters of {folder} (scaling {merge.scaling:g}, "
          f"{len(merge.weights)} weights) into the export")
    return merge


def _say_export_dtype(reader: TensorReader) -> None:
    """Name the dtype an export without --dtype is written in where it is not the checkpoint's: the model's own (its
    config.json's), while training kept another (fp32 on CPU, for a bf16 model too)."""
    from hybridrl.models.checkpoint import DTYPE_NAMES, hf_export_dtype, source_dtype

    written, stored = hf_export_dtype(reader), source_dtype(reader)
    if written != stored:
        print(f"hybridrl convert: writing {DTYPE_NAMES[written]}, the model's dtype (its config.json); the checkpoint "
              f"holds {DTYPE_NAMES[stored]} (it trained in that dtype): --dtype {DTYPE_NAMES[stored]} keeps those "
              "values exactly")


def lora_folder(ckpt: str) -> Path | None:
    """The PEFT adapter folder beside (or in) a LoRA actor's model checkpoint, or None."""
    return next((f for f in (Path(ckpt) / "lora", Path(ckpt).parent / "lora") if f.is_dir()), None)


def model_folder(ckpt: str, quiet: bool = False) -> str:
    """`--ckpt` as a user gives it: the model checkpoint itself, or a training checkpoint's role folder
    (`global_step_N/actor`, its weights in `model/`) or step folder (`global_step_N`: the actor's). Anything else is
    returned as given, for the reader to refuse by name."""
    from hybridrl.models.checkpoint import METADATA_FILE, MODEL_DIR
    from hybridrl.names import Role

    given = Path(ckpt)
    for folder in (given, given / MODEL_DIR, given / Role.ACTOR / MODEL_DIR):
        if (folder / METADATA_FILE).is_file():
            if folder != given and not quiet:
                print(f"hybridrl convert: reading the model checkpoint in {folder}")
            return str(folder)
    return ckpt


def _inputs(args: argparse.Namespace) -> dict[str, str | Path]:
    """What a conversion reads, by the flag that named it: the folder as given (a training checkpoint's step folder
    holds every role's model) and a LoRA actor's adapter folder; `--out` must keep apart from each."""
    if args.direction == "hf-to-mcore":
        return {"--hf": args.hf}
    inputs: dict[str, str | Path] = {"--ckpt": args.ckpt}
    adapters = lora_folder(model_folder(args.ckpt, quiet=True))
    if adapters is not None:
        inputs["the LoRA adapters of --ckpt"] = adapters
    return inputs


def run(args: argparse.Namespace) -> int:
    if args.direction == "gguf-to-hf":
        return _run_gguf_to_hf(args)
    # before anything is read or written: an --out that is, holds or lies inside the input would replace it; one
    # that cannot be written is refused before a large input is verified
    inputs = _inputs(args)
    try:
        check_apart(args.out, inputs, "--out")
        check_output_dir(args.out, args.force)
    except CheckpointError as exc:
        print(f"hybridrl convert: error: {exc}", file=sys.stderr)
        return 2
    if args.direction != "hf-to-mcore":
        args.ckpt = model_folder(args.ckpt)
    from tqdm import tqdm

    from hybridrl.models.checkpoint import (
        HFCheckpointReader,
        McoreCheckpointReader,
        parse_dtype,
        write_hf_checkpoint,
        write_mcore_checkpoint,
    )

    progress = not args.quiet
    dtype = parse_dtype(args.dtype)
    reader: HFCheckpointReader | McoreCheckpointReader | None = None
    try:
        if args.direction == "hf-to-mcore":
            reader = HFCheckpointReader(args.hf)
        else:
            reader = mcore = McoreCheckpointReader(args.ckpt, verify=False)
            with tqdm(total=mcore.num_tensors(), desc="verify sha256", unit="tensor", leave=False,
                      disable=not progress) as bar:
                mcore.verify(bar.update)
        if args.direction == "mcore-to-hf":
            if dtype is None:
                _say_export_dtype(reader)
            merge = _lora_merge(args.ckpt, reader.shape)
            out = write_hf_checkpoint(reader, args.out, dtype=dtype, max_shard_bytes=args.max_shard_size,
                                      force=args.force, progress=progress, adjust=merge, inputs=inputs)
        else:
            layout = ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                                    first_stage_layers=args.first_stage_layers,
                                    last_stage_layers=args.last_stage_layers, etp=args.etp)
            out = write_mcore_checkpoint(reader, args.out, layout, dtype=dtype, force=args.force,
                                         progress=progress)
    except (CheckpointError, UnsupportedModelError, ParallelLayoutError, FileNotFoundError) as exc:
        print(f"hybridrl convert: error: {exc}", file=sys.stderr)
        return 2  # the input is refused, as `plan` refuses a config
    finally:
        if reader is not None:
            reader.close()
    print(f"hybridrl convert: wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
