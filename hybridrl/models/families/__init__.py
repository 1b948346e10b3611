"""The supported model families, one file each: adding a family is one new module listed here."""
from __future__ import annotations

from hybridrl.models.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from hybridrl.models.family import ArchFamily

SUPPORTED_ARCHITECTURES: dict[str, ArchFamily] = {
    module.FAMILY.architecture: module.FAMILY for module in (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)
}
