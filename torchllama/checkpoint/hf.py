"""Hugging Face `LlamaForCausalLM` layout ↔ ours (Meta's): key names and the q/k permutation.

HF's `convert_llama_weights_to_hf.py` permutes the rows of wq and wk so that RoPE can be applied
with `rotate_half` (first half of each head rotated against the second half) instead of Meta's
interleaved pairs (2i, 2i+1). Within one head of width hd, Meta row 2i+c (c ∈ {0, 1}) becomes
HF row c·hd/2 + i. Undoing it needs the number of heads *of that matrix*: n_heads for wq,
n_kv_heads for wk (using n_heads for wk silently breaks every grouped-query model).
"""

from __future__ import annotations

import torch

from torchllama.config import ModelArgs


def permute_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from Meta's interleaved RoPE layout to HF's rotate_half layout.

    Args:
        w: (n_heads·head_dim, dim) weight of wq (n_heads) or wk (n_kv_heads).
        n_heads: number of heads of *this* matrix.

    Returns:
        (n_heads·head_dim, dim) tensor (a new tensor; w is unchanged).
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return (w.view(n_heads, hd // 2, 2, cols)   # (heads, hd/2 pairs, 2 members, dim)
             .transpose(1, 2)                   # (heads, 2 members, hd/2 pairs, dim)
             .reshape(rows, cols))


def permute_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_meta_to_hf`: HF rotate_half rows back to Meta's interleaved pairs.

    Args:
        w: (n_heads·head_dim, dim) HF q_proj (n_heads) or k_proj (n_kv_heads) weight.
        n_heads: number of heads of *this* matrix.
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return (w.view(n_heads, 2, hd // 2, cols)   # (heads, 2 halves, hd/2, dim)
             .transpose(1, 2)                   # (heads, hd/2, 2, dim)
             .reshape(rows, cols))


def hf_to_meta_state_dict(hf: dict[str, torch.Tensor], args: ModelArgs
                          ) -> dict[str, torch.Tensor]:
    """Rename and un-permute a `LlamaForCausalLM` state dict into our (Meta's) names.

    A missing `lm_head.weight` (tied embeddings) becomes `output.weight` = the embedding.
    Keys other than the listed ones (e.g. `rotary_emb.inv_freq`) are ignored.
    """
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "attention.wq.weight"] = permute_hf_to_meta(
            hf[p + "self_attn.q_proj.weight"], args.n_heads)
        out[q + "attention.wk.weight"] = permute_hf_to_meta(
            hf[p + "self_attn.k_proj.weight"], args.n_kv_heads)
        out[q + "attention.wv.weight"] = hf[p + "self_attn.v_proj.weight"]
        out[q + "attention.wo.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[q + "feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
        out[q + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[q + "feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
        out[q + "attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


def read_hf(path, dtype, progress=True):
    """(args, state dict, tokenizer) of a Hugging Face checkpoint folder."""
    from torchllama.errors import ModelFileError

    raise ModelFileError(f"{path}: Hugging Face checkpoints are not supported yet")
