"""Changes applied to a built model from outside it; the model (`torchllama.model`) stays the
readable reference and never imports these.

    quantize  weight-only quantization: int8/int4 and GGUF block weights on torchllama's kernels
    lora      LoRA / QLoRA / DoRA adapters: apply, load, save (PEFT's format), merge
    layout    the memory layout of linear weights (row- or column-major)
"""
