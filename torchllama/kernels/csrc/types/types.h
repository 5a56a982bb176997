// The GGUF block types the loader converts, as data: each type (or family of types) is one file
// of types/ that registers a `BlockType` row at start-up, next to its Python module
// (torchllama/blocks/<family>.py, which names the same arrays and is the readable form, the
// fallback without these kernels, and the tests' reference). gguf_blocks.cpp's op reads the
// rows; nothing else names a type.
//
// A row converts a matrix's blocks, as the file stores them, into the arrays of the kernel form
// the type runs on (its Python module's `arrays(rows, K)`: codes, scales, the K-quants' scale
// factors), one row of the matrix at a time, so the op can split rows over threads.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace torchllama {

struct BlockType {
  int64_t ggml;                 // the GGML type number (ggml.h enum ggml_type)
  const char* name;             // "Q4_0", …
  int64_t block_bytes;          // bytes of one block in the file (ggml-common.h)
  int64_t weights;              // weights per block (32, or 256 for a K-quant super-block)
  // Bytes per matrix row of each output array, for rows of K weights.
  std::vector<int64_t> (*widths)(int64_t K);
  // One row's nb blocks → that row's slice of each output array; returns how many of the row's
  // block scales are not finite (d, and m where the form has one).
  int64_t (*convert_row)(const uint8_t* blocks, int64_t nb, uint8_t* const* out);
};

// Adds a row (called by the types' files at static initialization); returns true.
bool register_block_type(const BlockType& type);
// The row of GGML type `ggml`, or null.
const BlockType* find_block_type(int64_t ggml);

// ---- helpers the types share ------------------------------------------------------------------

inline float half_at(const uint8_t* p) {                // a little-endian float16 → float32
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int64_t count_non_finite(const float* x, int n) {
  int64_t bad = 0;
  for (int i = 0; i < n; ++i) bad += !std::isfinite(x[i]);
  return bad;
}

}  // namespace torchllama
