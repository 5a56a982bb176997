// The kernels as data: the CPU's features, detected once, and the table of kernels chosen for
// them. No ATen here: the SIMD translation units (arch/*.cpp) include this file and no ATen
// (scalar.cpp only c10's float16 conversion); the ATen glue (blocks.cpp, layers.cpp) calls
// `table().q4_rows(…)` and never names an instruction set.
//
// The shape is ggml-cpu's (llama.cpp ggml/src/ggml-cpu/): cpu-feats.cpp scores the CPU once;
// quants.h declares each kernel with its `_generic` reference, arch/x86/quants.c the SIMD
// versions and arch-fallback.h maps the ones an architecture lacks to the reference. Here:
//   arch/scalar.cpp       every kernel, plain C++ (the reference; any x86-64)
//   arch/avx2.cpp         every kernel but rope_head, AVX2 + FMA + F16C (f32_to_f16 the last level
//                         that has it: AVX-512 has nothing to add)
//   arch/avx512.cpp       the float32 layer kernels, AVX-512 F/VL/BW (no VNNI needed)
//   arch/avx512_vnni.cpp  the activation quantization and the block products (vpdpbusd: Q4's
//                         decode and prefill tiles, Q8's prefill tiles), AVX-512 F/VL/BW + VNNI
// Each fills one `Kernels`, leaving null what it does not provide, and is one row of
// dispatch.cpp's ISAS; dispatch.cpp takes each kernel from the highest level the CPU has that
// provides it (the fallback is data: a CPU with
// AVX-512 but no VNNI runs the AVX-512 float kernels and the AVX2 block kernels; rope_head is
// scalar everywhere). Every level gives the same bits (blocks_impl.h, layers_impl.h).
#pragma once

#include <xmmintrin.h>   // _mm_prefetch (prefetch_row)

#include <cstdint>
#include <string>
#include <vector>

namespace torchllama {

// ---- a stream's prefetch (every level: the block products' one-row tiles, decode attention) --
// A stream read once per token (a weight row group after group, a KV head's keys and values)
// asks, for each line it reads, for the line PF_ROW bytes on into L1 and PF_ROW_L2 bytes on into
// L2 only (`_MM_HINT_T1`): an L1 prefetch holds one of the core's few L1 miss buffers until its
// line arrives, an L2 one only a slot of L2's larger queue, so the two together keep more of the
// stream in flight than either alone (`benchmarks/decode_compute.py` measures the products'
// streamed rate, docs/guides/quantized.md attention's). A prefetch never faults and changes no
// result.
#ifndef TL_PF_ROW_L2
#define TL_PF_ROW_L2 16384
#endif
constexpr int64_t PF_ROW = 4096, PF_ROW_L2 = TL_PF_ROW_L2;
static inline void prefetch_row(const uint8_t* p) {
  _mm_prefetch((const char*)(p + PF_ROW), _MM_HINT_T0);
  if (PF_ROW_L2 > 0) _mm_prefetch((const char*)(p + PF_ROW_L2), _MM_HINT_T1);
}

// ---- the kernels' arguments (plain data) ----------------------------------------------------

struct Act {            // int8 activations: q (M, K), d and s (M, K/32)
  const int8_t* q; const float* d; const float* s; int64_t M, K;
};
// How block scales are stored (blocks_impl.h, "The scales"): per scale j of a row group,
//   scale_f32 / scale_f16    (G, nd, 8): the 8 rows' values side by side;
//   scale_super_u8           (G, nd/8, 80) bytes: per super-block of 8 scales, the 8 rows'
//                            float16 D, then 8 × 8 unsigned sub-scales s: value D·s (Q4_K);
//   scale_super_i8           (G, nd/16, 144) bytes: the same with 16 signed sub-scales (Q6_K,
//                            Q3_K);
//   scale_super_i8_8         (G, nd/8, 80) bytes: 8 signed sub-scales a super-block (IQ4_XS);
//   scale_times_d            (Q4's m only) one float c: m = c·d (Q4_0: c = −8);
//   scale_pair_u4            (Q8's d and m in one buffer) (G, nd/16, 160) bytes: per
//                            super-block of 16 scales, the 8 rows' float16 D, their float16 M,
//                            then 16 × 8 bytes s | t << 4: d = D·s, m = M·t (Q2_K: D = d,
//                            M = −dmin, s = sc_j, t = mn_j).
enum ScaleForm : int32_t {
  scale_f32 = 0, scale_f16 = 1, scale_super_u8 = 2, scale_super_i8 = 3, scale_times_d = 4,
  scale_super_i8_8 = 5, scale_pair_u4 = 6
};
// Sub-scales per super-block of a super form, whether they are signed, and the bytes of a
// super-block's float16 part (the 8 rows' D, and M for scale_pair_u4).
constexpr int64_t subs_per_super(int32_t form) {
  return form == scale_super_u8 || form == scale_super_i8_8 ? 8 : 16;
}
constexpr bool signed_subs(int32_t form) {
  return form != scale_super_u8 && form != scale_pair_u4;
}
constexpr int64_t super_head(int32_t form) { return form == scale_pair_u4 ? 32 : 16; }
// Weights in the packed layout (blocks_impl.h): G groups of 8 rows. Q4: codes (G, K/32, 128)
// u8, d and m one scale per block of 32; five: 5-bit codes, (G, K/32, 160): the 4-bit codes, then
// a plane of their fifth bits (Q5_1, Q5_K). Q8: codes (G, K/32, 256) i8, d one scale per block
// of `block` (32 or 16); small: every |code| ≤ 32 (Q6_K, Q5_0, Q3_K), which lets int16 sums run
// longer; six: every code in [−32, 31] (Q6_K, Q5_0), stored in 6 bits, (G, K/32, 192) bytes;
// lut: every code one of 16 values (IQ4's grid, Q3_K's [−4, 3]), stored as 4-bit indices in
// Q4's arrangement, (G, K/32, 128) bytes, with the table of 16 int8 values (null: not so);
// two: every code in [0, 3] (Q2_K), stored in 2 bits, (G, K/32, 64) bytes. m: offsets, one a
// scale (w = d·q + m: Q2_K's −dmin·mn_j), in d's form (scale_pair_u4: m = d, one buffer
// holding both), or null (none).
struct Q4Weight {
  const uint8_t* codes; const void* d; const void* m; int64_t G, K;
  int32_t d_form, m_form; float m_mult;   // m_mult: c of scale_times_d
  bool five;
};
struct Q8Weight {
  const int8_t* codes; const void* d; int64_t G, K, block; int32_t d_form; bool small, six;
  const int8_t* lut;
  bool two = false;
  const void* m = nullptr;
};

// What a KV cache stores (torchllama.nn.kv_cache): float32, float16, bfloat16, or q8_0 records
// (per head vector of w numbers: w int8 codes, then w/32 float32 scales).
enum KvType : int32_t { kv_f32 = 0, kv_f16 = 1, kv_bf16 = 2, kv_q8_0 = 3 };
// Visible keys per attention tile: part of the float order (layers_impl.h), so fixed.
constexpr int64_t ATTN_TILE = 64;

// Attention of the n query heads that share one KV head (GQA) at one position: the keys and
// values as stored, the queries, the softmax's settings (layers_impl.h attend_tiles).
struct AttnArgs {
  const uint8_t* k; int64_t k_s;        // the key at index i: k + i·k_s bytes
  const uint8_t* v; int64_t v_s;
  int64_t hd, dv;                       // numbers per key and per value
  int32_t type;                         // KvType of keys and values
  float scale, softcap;                 // softcap 0: none
  const float* q; int64_t q_s;          // query head r (hd floats) at q + r·q_s
  const int8_t* qq; const float* qd;    // q8_0: head r rounded to int8 per 32 (quantize_block):
                                        // codes at qq + r·hd, scales at qd + r·hd/32
  int64_t n;                            // query heads
  const float* kt = nullptr;            // or null: the keys as float32 in blocks of 16 slots
                                        // (16u … 16u + 15) side by side, block u at
                                        // kt + u·hd·16, element i of slot 16u + j at [16i + j]
};

// One f32_linear product: x (M, K) and y (M, N) contiguous; w the (N, K) weight's data, row-major
// (for linear_rows) or Wᵀ as a contiguous (K, N) (a column-major weight, for linear_cols).
// A row-major W may also be stored in half precision (GGUF's F16, BF16 matrices): w16 with
// w16_type 1 (IEEE float16) or 2 (bfloat16), w null; each weight is converted to float32 (exact)
// in the registers, so the products are the float32 weights' bit for bit.
struct LinearArgs {
  const float* x; const float* w; float* y;
  int64_t M, N, K;
  const uint16_t* w16 = nullptr; int32_t w16_type = 0;
};

// ---- the table ------------------------------------------------------------------------------

// One instruction set's kernels (null: not provided at that level, taken from the level below).
struct Kernels {
  // int8 block products (blocks_impl.h): one block of 32 activations quantized; groups
  // [g0, g1) of 8 rows of W against every activation row, into y (M, 8·G)
  void (*quantize_block)(const float* x, int8_t* q, float* d, float* s) = nullptr;
  void (*q4_rows)(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) = nullptr;
  void (*q8_rows)(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1) = nullptr;
  // float32 layer kernels (layers_impl.h): RMSNorm of rows [m0, m1); RoPE of one head vector;
  // attention: tiles [t0, t1) of the visible keys idx[0, n_keys) folded into state (a.n ×
  // (m, l, o[dv])), and one state folded with another; f32_linear's outputs [n0, n1)
  // (linear_impl.h)
  void (*rms_norm_rows)(const float* x, const float* w, float* y, int64_t D, float eps,
                        bool unit_offset, int64_t m0, int64_t m1) = nullptr;
  void (*rope_head)(const float* x, const float* cs, float* y, int64_t pairs,
                    int64_t hd) = nullptr;
  // n float32 numbers as float16 bits, rounded to nearest even (a float16 KV cache's store)
  void (*f32_to_f16)(const float* x, uint16_t* y, int64_t n) = nullptr;
  void (*attend_tiles)(const AttnArgs& a, const int32_t* idx, int64_t n_keys, int64_t t0,
                       int64_t t1, bool fresh, float* state, float* scratch) = nullptr;
  void (*attend_fold)(float* state, const float* part, int64_t n, int64_t dv) = nullptr;
  void (*linear_rows)(const LinearArgs& a, int64_t n0, int64_t n1) = nullptr;
  void (*linear_cols)(const LinearArgs& a, int64_t n0, int64_t n1) = nullptr;
};

// Each filled by its own translation unit, compiled for its instruction set.
const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();
const Kernels& avx512_vnni_kernels();

// ---- the instruction sets --------------------------------------------------------------------

// The instruction sets, one row each in dispatch.cpp's ISAS (lowest first, each implying the
// ones before it): a name, whether the CPU has what the row adds, and its table of kernels.
// Adding one (say AVX-512 BF16) = one arch/ file filling a `Kernels` and one row there.
// Detected once per process, lowered by TORCHLLAMA_KERNELS_ISA = a row's name (or alias; the
// tests force each level; a level the CPU lacks is not forced on it).
std::vector<std::string> isa_names();            // every row's name, lowest first
const std::string& isa_in_use();                 // the highest row this CPU runs
// The kernels for isa_in_use(), every entry filled.
const Kernels& table();

// Where each kernel of the table for instruction set `name` comes from ("q4_rows=avx2", …):
// a table is only assembled, nothing runs, so any level can be inspected on any CPU
// (torch.ops.torchllama.kernel_levels; the tests check the AVX-512 mixes so).
std::vector<std::string> kernel_levels(const std::string& name);

}  // namespace torchllama
