"""A served adapter as it crosses the pools of a disaggregated run (`reshard.adapter_sync.ShippedAdapter`): the
PEFT folder's files, the digests vLLM must hold and the adapter's bytes packed into one payload and read back
exactly; a payload cut short or padded refused; the sends spread over the training ranks. (The send and receive
over a real cross-pool group, vLLM loading what arrived: the disaggregated LoRA run in tests/e2e/test_runs.py.)"""
from __future__ import annotations

import pytest
import torch

from hybridrl.config.meshes import adapter_sender
from hybridrl.models.lora import LoraSettings, peft_adapter_files
from hybridrl.reshard.adapter_sync import ShippedAdapter


def _adapter() -> ShippedAdapter:
    state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4)}
    files = peft_adapter_files(state, LoraSettings(rank=4, alpha=8.0), base_model="some/model")
    return ShippedAdapter(files, {"a": "d1", "b": "d2"}, adapter_bytes=2 * 64 * 4)


def test_a_shipped_adapter_reads_back_exactly():
    from safetensors.torch import load

    adapter = _adapter()
    payload = adapter.pack()
    back = ShippedAdapter.unpack(payload)
    assert back == adapter
    assert sorted(back.files) == ["adapter_config.json", "adapter_model.safetensors"]
    header = int.from_bytes(payload[:8], "little")
    assert len(payload) == 8 + header + sum(len(data) for data in adapter.files.values())
    tensors = load(back.files["adapter_model.safetensors"])
    assert tensors.keys() == {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}


@pytest.mark.parametrize("change", [lambda p: p[:-1], lambda p: p + b"\0"], ids=["cut-short", "padded"])
def test_a_payload_whose_length_disagrees_with_its_header_is_refused(change):
    with pytest.raises(ValueError, match="whose header accounts for"):
        ShippedAdapter.unpack(change(_adapter().pack()))


def test_the_sends_spread_over_the_training_ranks():
    assert [adapter_sender(q, 2) for q in range(5)] == [0, 1, 0, 1, 0]
    assert [adapter_sender(q, 4) for q in range(2)] == [0, 1]
    assert [adapter_sender(q, 1) for q in range(3)] == [0, 0, 0]
