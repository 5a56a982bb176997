"""How much memory a model's KV cache takes, from its configuration alone (`torchllama kv-cache`).

Per token, a layer caches (bytes = elements × the cache dtype's size; q8_0, torchllama's
int8 cache: 36 bytes per 32 numbers, 32 codes and a float32 scale):
- multi-head / grouped-query / multi-query attention: a key and a value of head_dim per KV head,
  2 · n_kv_heads · head_dim elements;
- multi-head latent attention (DeepSeek-V2 §2.1): the latent c_kv and the decoupled RoPE key,
  kv_lora_rank + qk_rope_head_dim elements, whatever the number of heads.
A sliding-window layer keeps only its last `window` tokens; a global layer keeps them all. (The
sliding-window caches torchllama allocates keep 64 slots more, for rewinds; that margin is not
counted here: these are the architecture's numbers.)
"""

from __future__ import annotations

from dataclasses import dataclass

from torchllama.config import ModelArgs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "q8_0": 1.125, "float8": 1}


@dataclass
class LayerCache:
    """The KV cache of one kind of layer.

    Attributes:
        layers: indices of the layers of this kind.
        kind: "global" or "local (window N)".
        elements_per_token: cached numbers per token per layer.
        tokens: tokens each layer keeps (for the requested sequence length).
    """

    layers: list[int]
    kind: str
    elements_per_token: int
    tokens: int


# --8<-- [start:kv-layers]
def layer_caches(args: ModelArgs, seq_len: int) -> list[LayerCache]:
    """The model's layers grouped by what their KV caches hold, for a sequence of seq_len."""
    if args.attention == "mla":
        per_token = args.kv_lora_rank + args.qk_rope_head_dim
    else:
        per_token = 2 * args.n_kv_heads * args.head_dim
    groups: dict[str, LayerCache] = {}
    for i, spec in enumerate(args.layer_specs()):
        kind = f"local (window {spec.window})" if spec.kind == "local" else "global"
        tokens = min(spec.window, seq_len) if spec.kind == "local" else seq_len
        groups.setdefault(kind, LayerCache([], kind, per_token, tokens)).layers.append(i)
    return list(groups.values())
# --8<-- [end:kv-layers]


# --8<-- [start:kv-bytes]
def kv_cache_bytes(args: ModelArgs, seq_len: int, batch_size: int = 1,
                   dtype: str = "bfloat16") -> int:
    """Total KV cache bytes of the model for batch_size sequences of seq_len tokens."""
    size = DTYPE_BYTES[dtype]
    return round(sum(len(g.layers) * g.elements_per_token * g.tokens * batch_size * size
                     for g in layer_caches(args, seq_len)))
# --8<-- [end:kv-bytes]


def kv_bytes_per_token(args: ModelArgs, dtype: str = "bfloat16") -> int:
    """Bytes one more token adds to the cache of every layer that keeps all tokens, plus those of
    the windowed layers (each token is cached by every layer while it is in its window)."""
    size = DTYPE_BYTES[dtype]
    return round(sum(len(g.layers) * g.elements_per_token * size for g in layer_caches(args, 1)))


def attention_variants(args: ModelArgs) -> dict[str, ModelArgs]:
    """The same model with four kinds of attention, for `--compare-attention`: MHA (a KV head per
    query head), GQA with 8 query heads per KV head, MQA (one KV head) and MLA. MLA takes the
    model's own ranks if it has them, else DeepSeek-V2's choice (§2.1.4): kv_lora_rank = 4 ·
    head_dim and qk_rope_head_dim = head_dim / 2."""
    head_dim = args.v_head_dim if args.attention == "mla" else args.head_dim
    base = dict(attention="mha", q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=None,
                qk_rope_head_dim=None, v_head_dim=None, head_dim=head_dim, rope_scaling=None,
                rotary_dim=None)
    mla = dict(attention="mla", n_kv_heads=args.n_heads,
               kv_lora_rank=args.kv_lora_rank or 4 * head_dim,
               qk_rope_head_dim=args.qk_rope_head_dim or head_dim // 2,
               qk_nope_head_dim=args.qk_nope_head_dim or head_dim,
               v_head_dim=head_dim, rope_scaling=None, rotary_dim=None)
    gqa = max(1, args.n_heads // 8)
    return {
        "MHA": args.replace(**base, n_kv_heads=args.n_heads),
        f"GQA ({args.n_heads // gqa} query heads per KV head)": args.replace(**base,
                                                                             n_kv_heads=gqa),
        "MQA": args.replace(**base, n_kv_heads=1),
        "MLA": args.replace(**mla),
    }


def human(n: float) -> str:
    """Bytes in decimal and binary units: '70.3 KB (68.6 KiB)'."""
    if n < 1000:
        return f"{n:,.0f} B"
    for unit, (dec, binary) in (("K", (1e3, 2 ** 10)), ("M", (1e6, 2 ** 20)),
                                ("G", (1e9, 2 ** 30)), ("T", (1e12, 2 ** 40))):
        if n < dec * 1000 or unit == "T":
            return f"{n / dec:,.1f} {unit}B ({n / binary:,.1f} {unit}iB)"
    return f"{n} B"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 4, 5, 7] → '0-2,4-5,7'."""
    parts, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ",".join(parts)


def describe(args: ModelArgs) -> str:
    """One line on the attention the cache size comes from."""
    if args.attention == "mla":
        return (f"MLA: kv_lora_rank {args.kv_lora_rank} + qk_rope_head_dim "
                f"{args.qk_rope_head_dim} per token")
    kind = ("MHA" if args.n_kv_heads == args.n_heads else
            "MQA" if args.n_kv_heads == 1 else "GQA")
    heads = f"{args.n_kv_heads} KV head{'s' if args.n_kv_heads > 1 else ''}"
    return f"{kind}: {heads} × head_dim {args.head_dim} × (K, V)"


def report(args: ModelArgs, name: str, seq_len: int, batch_size: int, dtype: str,
           compare_attention: bool = False) -> str:
    """The text `torchllama kv-cache` prints."""
    size = DTYPE_BYTES[dtype]
    lines = [f"{name}: {args.n_layers} layers, {describe(args)}",
             f"{dtype} ({size} bytes), batch {batch_size}, {seq_len:,} tokens", ""]
    header = f"{'layers':<22}{'kind':<20}{'per token/layer':>18}{'tokens kept':>13}"
    lines += [header + f"{'per layer':>26}", "-" * (len(header) + 26)]
    total = 0
    for g in layer_caches(args, seq_len):
        per_layer = round(g.elements_per_token * g.tokens * batch_size * size)
        total += per_layer * len(g.layers)
        span = _ranges(g.layers)
        span = span if len(span) <= 16 else f"{len(g.layers)} layers"
        lines.append(f"{span + f' ({len(g.layers)})':<22}{g.kind:<20}"
                     f"{round(g.elements_per_token * size):>16,} B{g.tokens:>13,}"
                     f"{human(per_layer):>26}")
    per_token = kv_bytes_per_token(args, dtype)
    lines += ["", f"per token, all layers: {human(per_token)}"
              + (" (sliding-window layers count while the token is in their window)"
                 if any(g.kind != "global" for g in layer_caches(args, seq_len)) else ""),
              f"whole context × batch: {human(total)}"]
    if compare_attention:
        lines += ["", f"the same model with other attention ({dtype}, {seq_len:,} tokens):",
                  f"{'attention':<40}{'per token':>24}{'whole context':>28}"]
        for label, variant in attention_variants(args).items():
            lines.append(f"{label:<40}{human(kv_bytes_per_token(variant, dtype)):>24}"
                         f"{human(kv_cache_bytes(variant, seq_len, batch_size, dtype)):>28}")
    return "\n".join(lines)
