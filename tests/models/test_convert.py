"""`hybridrl convert` end to end on tiny real HF models: round trips, re-sharding, bad input."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.models.checkpoint import METADATA_FILE
from hybridrl.models.convert_cli import main as convert_main
from hybridrl.persistence import is_partial
from tests.support.models_fixtures import (
    ARCHS,
    assert_same_tensors,
    hf_logits,
    make_hf_model,
    per_file_state,
    read_json,
    safetensors_state,
    sample_tokens,
    tree_snapshot,
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert_hf")
    dirs = {arch: make_hf_model(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}
    # A tokenizer file rides along through conversions (content is irrelevant to the weights).
    (dirs["llama"] / "tokenizer.json").write_text('{"version": "1.0"}')
    return dirs


def convert(*argv: str) -> int:
    return convert_main([*argv, "--quiet"])


def to_mcore(hf: Path, out: Path, tp: int = 1, pp: int = 1, vpp: int | None = None, *extra: str) -> Path:
    args = ["hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", str(tp), "--pp", str(pp), *extra]
    if vpp:
        args += ["--vpp", str(vpp)]
    assert convert(*args) == 0
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, pp, vpp", [(2, 2, None), (1, 2, 2)])
def test_hf_mcore_hf_round_trip_is_bit_exact(hf_dirs, tmp_path, arch, tp, pp, vpp):
    ckpt = to_mcore(hf_dirs[arch], tmp_path / "mcore", tp, pp, vpp)
    meta = read_json(ckpt / METADATA_FILE)
    assert meta["layout"] == {"tp": tp, "pp": pp, "vpp": vpp}
    assert meta["architecture"] == read_json(hf_dirs[arch] / "config.json")["architectures"][0]
    assert len(meta["files"]) == tp * pp and meta["padded_vocab_size"] == 256
    for entry in meta["files"].values():
        assert all(len(t["sha256"]) == 64 for t in entry["tensors"].values())
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")) == 0
    assert_same_tensors(safetensors_state(hf_dirs[arch]), safetensors_state(tmp_path / "hf"))
    assert read_json(tmp_path / "hf" / "config.json") == read_json(hf_dirs[arch] / "config.json")
    assert read_json(tmp_path / "hf" / "generation_config.json") == read_json(
        hf_dirs[arch] / "generation_config.json")


def test_a_yarn_models_config_survives_the_round_trip(tmp_path):
    """A Qwen2 whose config.json carries YaRN in transformers 4's `rope_scaling` (as Qwen ships it): hf -> mcore (TP2)
    -> hf keeps config.json as it was, and the checkpoint's shape reads the same YaRN."""
    from hybridrl.models.arch import ModelShape

    hf = make_hf_model(tmp_path / "qwen2", "qwen2", seed=3)
    config = {k: v for k, v in read_json(hf / "config.json").items() if k != "rope_parameters"}
    config.update(rope_theta=10000.0, max_position_embeddings=128,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    (hf / "config.json").write_text(json.dumps(config))
    ckpt = to_mcore(hf, tmp_path / "mcore", 2, 1)
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")) == 0
    assert read_json(tmp_path / "back" / "config.json") == config
    shape = ModelShape.from_hf_dir(tmp_path / "back")
    assert (shape.rope_yarn_factor, shape.rope_yarn_original_max_position_embeddings) == (4.0, 32)
    assert shape == ModelShape.from_hf_dir(hf)


def test_vocab_padding_rows_are_zero_and_stripped(hf_dirs, tmp_path):
    ckpt = to_mcore(hf_dirs["llama"], tmp_path / "mcore", tp=2)
    rank1 = safetensors_state_file(ckpt / "model_tp01_pp000.safetensors")
    emb = rank1["embedding.word_embeddings.weight"]  # padded vocab 256: rank 1 holds rows 128..255
    assert emb.shape == (128, 64)
    original = safetensors_state(hf_dirs["llama"])["model.embed_tokens.weight"]
    assert torch.equal(emb[:72], original[128:200]) and not emb[72:].any()
    assert not rank1["output_layer.weight"][72:].any()


def safetensors_state_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("arch, source, target", [
    ("qwen3", (2, 2, None), (1, 1, None)),
    ("qwen2", (1, 2, 2), (2, 1, None)),
    ("llama", (4, 1, None), (1, 2, None)),  # 4 TP ranks over 2 KV heads and back
])
def test_reshard_equals_direct_conversion(hf_dirs, tmp_path, arch, source, target):
    ckpt = to_mcore(hf_dirs[arch], tmp_path / "src", *source)
    tp, pp, vpp = target
    args = ["mcore-to-mcore", "--ckpt", str(ckpt), "--out", str(tmp_path / "resharded"),
            "--tp", str(tp), "--pp", str(pp)]
    assert convert(*args) == 0
    direct = to_mcore(hf_dirs[arch], tmp_path / "direct", tp, pp, vpp)
    assert_same_tensors(per_file_state(tmp_path / "resharded"), per_file_state(direct))
    resharded_meta, direct_meta = read_json(tmp_path / "resharded" / METADATA_FILE), read_json(direct / METADATA_FILE)
    assert resharded_meta["files"] == direct_meta["files"]  # same sha256 for every tensor


def test_sharded_hf_export_loads_in_transformers(hf_dirs, tmp_path):
    ckpt = to_mcore(hf_dirs["qwen3"], tmp_path / "mcore", 2, 2)
    out = tmp_path / "hf"
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--max-shard-size", "60KB") == 0
    index = read_json(out / "model.safetensors.index.json")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in safetensors_state(out).values())
    assert (out / "generation_config.json").is_file()
    tokens = sample_tokens()
    assert torch.equal(hf_logits(out, tokens), hf_logits(hf_dirs["qwen3"], tokens))
    # A sharded HF folder is also a valid input.
    again = to_mcore(out, tmp_path / "again", 2, 2)
    assert_same_tensors(per_file_state(again), per_file_state(ckpt))
    (out / shards[-1]).unlink()
    assert convert("hf-to-mcore", "--hf", str(out), "--out", str(tmp_path / "broken")) == 2
    assert not (tmp_path / "broken").exists()


def test_dtype_conversion_and_assets(hf_dirs, tmp_path):
    ckpt = to_mcore(hf_dirs["llama"], tmp_path / "mcore", 2, 1, None, "--dtype", "bf16")
    assert read_json(ckpt / METADATA_FILE)["dtype"] == "bfloat16"
    assert (ckpt / "hf_assets" / "tokenizer.json").is_file()
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")) == 0
    exported = safetensors_state(tmp_path / "hf")
    original = safetensors_state(hf_dirs["llama"])
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert read_json(tmp_path / "hf" / "config.json")["dtype"] == "bfloat16"
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_a_model_trained_in_another_dtype_exports_in_its_own(hf_dirs, tmp_path, capsys):
    """A training checkpoint keeps the model's config.json and the training dtype's tensors: a bf16 model trained on
    CPU (fp32, the CPU's default) exported as fp32, twice the size of what the user brought, unless --dtype bf16. The
    export is now in the model's declared dtype, saying so; --dtype float32 keeps the trained values. A dtype asked
    for at hf-to-mcore becomes the model's (test_dtype_conversion_and_assets: exported back in it)."""
    ckpt = to_mcore(hf_dirs["llama"], tmp_path / "trained", 2, 1)  # fp32 tensors
    meta = read_json(ckpt / METADATA_FILE)
    assert meta["dtype"] == "float32" and meta["hf_config"]["dtype"] == "float32"
    meta["hf_config"]["dtype"] = "bfloat16"  # the model's config.json as the trainer keeps it: a bf16 model
    (ckpt / METADATA_FILE).write_text(json.dumps(meta))
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")) == 0
    assert ("writing bfloat16, the model's dtype (its config.json); the checkpoint holds float32 (it trained in that "
            "dtype): --dtype float32 keeps those values exactly") in capsys.readouterr().out
    trained = safetensors_state(hf_dirs["llama"])
    exported = safetensors_state(tmp_path / "hf")
    assert exported.keys() == trained.keys()
    for name, tensor in trained.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert read_json(tmp_path / "hf" / "config.json")["dtype"] == "bfloat16"
    assert convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "fp32"), "--dtype", "float32") == 0
    assert "writing bfloat16" not in capsys.readouterr().out
    assert_same_tensors(safetensors_state(tmp_path / "fp32"), trained)
    assert read_json(tmp_path / "fp32" / "config.json")["dtype"] == "float32"


# ---- bad input: clear error, output untouched ---------------------------------------------------

@pytest.fixture()
def guarded_out(tmp_path):
    """An existing output folder with content: failing commands (even with --force) must keep it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    return out


def assert_untouched(out: Path) -> None:
    assert tree_snapshot(out) == {"keep.txt": b"precious"}
    leftovers = [p.name for p in out.parent.iterdir() if is_partial(p)]
    assert leftovers == []


@pytest.mark.parametrize("given", ["global_step_3", "global_step_3/actor"])
def test_a_training_checkpoints_step_or_role_folder_converts_the_actors_model(hf_dirs, tmp_path, capsys, given):
    """A user points `--ckpt` at what training wrote (`global_step_N/<role>/model` beside the optimizer's state):
    the step folder or the actor's folder reads the actor's model, and says which folder it read."""
    step = tmp_path / "global_step_3"
    to_mcore(hf_dirs["llama"], step / "actor" / "model", 2, 1)
    to_mcore(hf_dirs["qwen2"], step / "critic" / "model", 1, 1)  # another role's model: never the one read
    assert convert("mcore-to-hf", "--ckpt", str(tmp_path / given), "--out", str(tmp_path / "hf")) == 0
    assert f"reading the model checkpoint in {step / 'actor' / 'model'}" in capsys.readouterr().out
    assert_same_tensors(safetensors_state(hf_dirs["llama"]), safetensors_state(tmp_path / "hf"))
    assert convert("mcore-to-mcore", "--ckpt", str(tmp_path / given), "--out", str(tmp_path / "tp1"), "--tp", "1") == 0
    assert read_json(tmp_path / "tp1" / METADATA_FILE)["layout"]["tp"] == 1


def test_a_folder_holding_no_checkpoint_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "global_step_3" / "actor").mkdir(parents=True)
    assert convert("mcore-to-hf", "--ckpt", str(tmp_path / "global_step_3"), "--out", str(tmp_path / "hf")) == 2
    assert f"{tmp_path / 'global_step_3'} is not a hybridrl megatron checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    # verl's (actor/dist_ckpt: megatron dist-checkpointing) is named as such, with the way to its weights
    (tmp_path / "global_step_3" / "actor" / "dist_ckpt").mkdir()
    assert convert("mcore-to-hf", "--ckpt", str(tmp_path / "global_step_3" / "actor" / "dist_ckpt"),
                   "--out", str(tmp_path / "hf")) == 2
    err = capsys.readouterr().err
    assert f"it is a verl checkpoint ({tmp_path / 'global_step_3'}: actor/dist_ckpt, data.pt), not hybridrl's" in err
    assert "python -m verl.model_merger merge --backend megatron" in err and not (tmp_path / "hf").exists()


def _copy_hf(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _fails(capsys, *argv: str) -> str:
    assert convert(*argv, "--force") == 2
    return capsys.readouterr().err


def test_tampered_tensor_is_named(hf_dirs, tmp_path, guarded_out, capsys):
    ckpt = to_mcore(hf_dirs["llama"], tmp_path / "mcore", 2, 2)
    target = ckpt / "model_tp01_pp001.safetensors"
    raw = bytearray(target.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_len])
    name, info = max(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][1])
    raw[8 + header_len + info["data_offsets"][0] + 1] ^= 0x01  # flip one bit inside that tensor
    target.write_bytes(bytes(raw))
    err = _fails(capsys, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(guarded_out))
    assert "checksum mismatch" in err and target.name in err and name in err
    assert_untouched(guarded_out)


def test_missing_rank_file(hf_dirs, tmp_path, guarded_out, capsys):
    ckpt = to_mcore(hf_dirs["llama"], tmp_path / "mcore", 2, 1)
    (ckpt / "model_tp01_pp000.safetensors").unlink()
    err = _fails(capsys, "mcore-to-mcore", "--ckpt", str(ckpt), "--out", str(guarded_out), "--tp", "1")
    assert "model_tp01_pp000.safetensors is missing" in err
    assert_untouched(guarded_out)


def test_missing_hf_weights(hf_dirs, tmp_path, guarded_out, capsys):
    hf = _copy_hf(hf_dirs["llama"], tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert "no model.safetensors" in err
    assert_untouched(guarded_out)
    err = _fails(capsys, "hf-to-mcore", "--hf", str(tmp_path / "nowhere"), "--out", str(guarded_out))
    assert "does not exist" in err
    assert_untouched(guarded_out)


def test_missing_hf_tensor(hf_dirs, tmp_path, guarded_out, capsys):
    from safetensors.torch import save_file

    hf = _copy_hf(hf_dirs["qwen2"], tmp_path / "hf")
    state = safetensors_state(hf)
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert "missing tensors" in err and "model.layers.1.self_attn.k_proj.bias" in err
    assert_untouched(guarded_out)


def test_mismatched_shapes(hf_dirs, tmp_path, guarded_out, capsys):
    hf = _copy_hf(hf_dirs["mistral"], tmp_path / "hf")
    config = read_json(hf / "config.json")
    config["intermediate_size"] = 128
    (hf / "config.json").write_text(json.dumps(config))
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out), "--tp", "2")
    assert "model.layers.0.mlp.gate_proj.weight" in err and "[96, 64]" in err and "[128, 64]" in err
    assert_untouched(guarded_out)


def test_unsupported_architecture(hf_dirs, tmp_path, guarded_out, capsys):
    hf = _copy_hf(hf_dirs["llama"], tmp_path / "hf")
    config = read_json(hf / "config.json")
    config["architectures"] = ["FalconForCausalLM"]
    (hf / "config.json").write_text(json.dumps(config))
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert "FalconForCausalLM" in err and "Qwen3ForCausalLM" in err
    assert_untouched(guarded_out)


@pytest.mark.parametrize("keep", [100_000, 50])
def test_a_truncated_safetensors_file_is_named(hf_dirs, tmp_path, guarded_out, capsys, keep):
    """A download cut short (within the data, or within the header): the file named, exit 2, no traceback."""
    hf = _copy_hf(hf_dirs["llama"], tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert f"cannot read {weights}" in err and "not a complete safetensors file" in err and "Traceback" not in err
    assert_untouched(guarded_out)


@pytest.mark.parametrize("index", ["{not json", "[1, 2]", '{"metadata": {}}'])
def test_a_broken_safetensors_index_is_named(hf_dirs, tmp_path, guarded_out, capsys, index):
    hf = _copy_hf(hf_dirs["llama"], tmp_path / "hf")
    (hf / "model.safetensors.index.json").write_text(index)
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert f"{hf / 'model.safetensors.index.json'} is not a safetensors index" in err
    assert_untouched(guarded_out)


@pytest.mark.parametrize("content, says", [("[1, 2]", "holds a JSON array, not an object"),
                                           ('{"architectures": [', "is not valid JSON")])
def test_a_config_json_that_is_no_json_object_is_named(hf_dirs, tmp_path, guarded_out, capsys, content, says):
    hf = _copy_hf(hf_dirs["llama"], tmp_path / "hf")
    (hf / "config.json").write_text(content)
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(guarded_out))
    assert f"{hf / 'config.json'} {says}" in err and "Traceback" not in err
    assert_untouched(guarded_out)


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_an_output_under_a_file_is_refused_naming_the_file(hf_dirs, tmp_path, capsys, direction):
    """`--out afile/y`, afile a file: the folder cannot be created. Refused up front naming afile, nothing written
    beside it."""
    source = hf_dirs["llama"] if direction == "hf-to-mcore" else to_mcore(hf_dirs["llama"], tmp_path / "mcore")
    afile = tmp_path / "afile"
    afile.write_text("a file")
    before = sorted(p.name for p in tmp_path.iterdir())
    flag = "--hf" if direction == "hf-to-mcore" else "--ckpt"
    err = _fails(capsys, direction, flag, str(source), "--out", str(afile / "y" / "z"))
    assert f"cannot write output {afile / 'y' / 'z'}: {afile} is a file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and afile.read_text() == "a file"


def test_tp_that_does_not_divide_heads(hf_dirs, guarded_out, capsys):
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(guarded_out), "--tp", "3")
    assert "tp=3 does not divide num_attention_heads=4" in err
    assert_untouched(guarded_out)
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(guarded_out), "--pp", "3")
    assert "num_hidden_layers=4 is not divisible by pp*vpp=3" in err
    assert_untouched(guarded_out)


def test_not_enough_disk_space(hf_dirs, guarded_out, capsys, monkeypatch):
    import shutil as real_shutil

    from hybridrl import persistence

    usage = real_shutil.disk_usage(guarded_out)
    monkeypatch.setattr(persistence.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    err = _fails(capsys, "hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(guarded_out))
    assert "not enough free disk space" in err
    assert_untouched(guarded_out)


def test_non_empty_output_needs_force(hf_dirs, guarded_out, capsys):
    args = ["hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(guarded_out)]
    assert convert(*args) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert_untouched(guarded_out)
    assert convert(*args, "--force") == 0
    assert not (guarded_out / "keep.txt").exists() and (guarded_out / METADATA_FILE).is_file()


# ---- an --out that is, holds or lies inside the input: refused before anything is touched ----------------

@pytest.mark.parametrize("where", ["the input", "its parent", "inside it", "a link to it"])
@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf", "mcore-to-mcore"])
def test_an_output_over_its_input_is_refused_and_the_input_kept(hf_dirs, tmp_path, capsys, direction, where):
    """`--out` the source itself replaced the model with the conversion; `--out` a folder above it (with --force)
    deleted the source and everything beside it. Refused (exit 2) naming both paths, with --force, every file of
    the source and its siblings as it was, nothing staged."""
    root = tmp_path / "models"
    if direction == "hf-to-mcore":
        source, flag = _copy_hf(hf_dirs["llama"], root / "src"), "--hf"
    else:
        source, flag = to_mcore(hf_dirs["llama"], root / "src", tp=2), "--ckpt"
    (root / "sibling.txt").write_text("beside the source")
    out = {"the input": source, "its parent": root, "inside it": source / "sub"}.get(where)
    if out is None:
        out = tmp_path / "link"
        out.symlink_to(source, target_is_directory=True)
    before = tree_snapshot(tmp_path)
    extra = ["--tp", "1"] if direction != "mcore-to-hf" else []
    assert convert(direction, flag, str(source), "--out", str(out), *extra, "--force") == 2
    err = capsys.readouterr().err
    relation = {"the input": "is", "its parent": "contains", "inside it": "is inside", "a link to it": "is"}[where]
    assert f"--out {out} {relation} {flag} {source}" in err and "Traceback" not in err
    assert tree_snapshot(tmp_path) == before
    assert [p for p in tmp_path.rglob("*") if is_partial(p)] == []


def test_an_output_over_a_training_checkpoints_other_roles_is_refused(hf_dirs, tmp_path, capsys):
    """`--ckpt global_step_N` reads the actor's model, but the step folder holds every role's: an --out inside it
    (the critic's model, with --force) would replace another role's weights."""
    step = tmp_path / "global_step_3"
    to_mcore(hf_dirs["llama"], step / "actor" / "model")
    critic = to_mcore(hf_dirs["qwen2"], step / "critic" / "model")
    before = tree_snapshot(step)
    assert convert("mcore-to-hf", "--ckpt", str(step), "--out", str(critic), "--force") == 2
    assert f"--out {critic} is inside --ckpt {step}" in capsys.readouterr().err
    assert tree_snapshot(step) == before


def test_the_writers_themselves_keep_apart_from_their_input(hf_dirs, tmp_path):
    """The check sits where the output folder is claimed (`persistence.check_output_dir`, called by every
    writer), so a caller of the library is kept from the same loss as the command's user."""
    from hybridrl.models.checkpoint import HFCheckpointReader, write_mcore_checkpoint
    from hybridrl.models.layout import ParallelLayout
    from hybridrl.persistence import CheckpointError

    source = _copy_hf(hf_dirs["llama"], tmp_path / "models" / "src")
    before = tree_snapshot(tmp_path)
    reader = HFCheckpointReader(source)
    try:
        with pytest.raises(CheckpointError, match="contains the input checkpoint"):
            write_mcore_checkpoint(reader, tmp_path / "models", ParallelLayout(tp=1, pp=1), force=True)
    finally:
        reader.close()
    assert tree_snapshot(tmp_path) == before


def test_tools_wrapper_and_light_cli_import():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "tools" / "convert_checkpoint.py"), "--help"],
                            capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root)})
    assert result.returncode == 0 and "hf-to-mcore" in result.stdout
    code = ("import argparse, sys; from hybridrl.models import convert_cli; "
            "convert_cli.add_arguments(argparse.ArgumentParser()); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)})


def test_registered_as_hybridrl_subcommand(hf_dirs, tmp_path):
    from hybridrl.cli import main as hybridrl_main

    out = tmp_path / "mcore"
    assert hybridrl_main(["convert", "hf-to-mcore", "--hf", str(hf_dirs["qwen2"]), "--out", str(out),
                          "--quiet"]) == 0
    assert (out / "model_tp00_pp000.safetensors").is_file()
