"""Model families: how each family's checkpoints name our parameters, and how its config files
map to `ModelArgs` (see `torchllama.families.base`).

Adding a family is one module here (its name table and config translations) plus its entry in
`FAMILIES`; the loaders, converters and the training code read everything from it.
"""

from __future__ import annotations

from typing import Any

from torchllama.errors import ArgumentError, ModelFileError
from torchllama.families.base import (Family, Layout, Mapping, RopePermuted, Tensors,
                                      permute_hf_to_meta, permute_meta_to_hf)
from torchllama.families.deepseek import DEEPSEEK_V3
from torchllama.families.gemma import GEMMA2, GEMMA3
from torchllama.families.gpt2 import GPT2
from torchllama.families.llama import LLAMA, MISTRAL, QWEN2
from torchllama.families.mpt import MPT
from torchllama.families.moe import MIXTRAL, OLMOE, QWEN3_MOE
from torchllama.families.qwen3 import QWEN3

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL,
                                                   QWEN3_MOE, OLMOE, GEMMA2, GEMMA3, GPT2,
                                                   DEEPSEEK_V3, MPT)}


def family_for_hf(config: dict[str, Any], source: str) -> Family:
    """The family of a Hugging Face config.json (its `architectures`, else its `model_type`).

    Raises:
        ModelFileError: a malformed `architectures`, an architecture no family reads, or a
            quantized checkpoint.
    """
    archs = config.get("architectures")
    if archs is not None and not (
            isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelFileError(f"{source}: 'architectures' is {archs!r}, expected a list of names")
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else method
        raise ModelFileError(
            f"{source}: quantized checkpoints ({method}) are not supported; use a float16/bfloat16/"
            "float32 checkpoint or a GGUF file")
    for family in FAMILIES.values():
        if set(archs or ()) & set(family.hf_architectures) or (
                not archs and config.get("model_type") == family.hf_model_type):
            return family
    found = ", ".join(archs) if archs else f"model_type {config.get('model_type')!r}"
    supported = ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ModelFileError(f"{source}: unsupported architecture {found} (supported: {supported})")


def family_for_gguf(metadata: dict[str, Any], source: str) -> Family:
    """The family of a GGUF file (its `general.architecture`).

    Raises:
        ModelFileError: an architecture no family reads.
    """
    arch = metadata.get("general.architecture")
    for family in FAMILIES.values():
        if family.gguf_architecture is not None and arch == family.gguf_architecture:
            return family
    supported = ", ".join(dict.fromkeys(f.gguf_architecture for f in FAMILIES.values()
                                        if f.gguf_architecture))   # Mistral's is llama's
    raise ModelFileError(
        f"{source}: architecture {arch!r} (general.architecture) is not supported; "
        f"supported: {supported}")


def family_for_args(args, fmt: str) -> Family:
    """The family whose `fmt` ("hf" or "gguf") files can hold a model with these args.

    Raises:
        ArgumentError: none can (the message says why, for each family that has that format).
    """
    reasons = []
    for family in FAMILIES.values():
        if (fmt == "hf" and family.hf_config is None) or \
                (fmt == "gguf" and family.gguf_metadata is None):
            continue
        why = family.unsupported(args, fmt)
        if why is None:
            return family
        reasons.append(f"{family.name}: {why}")
    raise ArgumentError(f"no {fmt} architecture can hold this model ({'; '.join(reasons)}); "
                        "save it with --to meta")


__all__ = ["FAMILIES", "Family", "Layout", "Mapping", "RopePermuted", "Tensors",
           "family_for_args", "family_for_gguf", "family_for_hf", "permute_hf_to_meta",
           "permute_meta_to_hf", "DEEPSEEK_V3", "GEMMA2", "GEMMA3", "GPT2", "LLAMA", "MISTRAL",
           "MPT", "QWEN2"]
