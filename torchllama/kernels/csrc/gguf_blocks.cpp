// The GGUF loader's conversion of a matrix's blocks, from the file's bytes to the arrays of the
// kernel form its type runs on (torchllama.blocks: each type's `arrays`): one pass over the
// mapped bytes, rows split over threads. The types are the rows of types/ (types.h): this op
// only checks the arguments and runs a row's `convert_row` on every matrix row.
//
// Op:
//   gguf_blocks(raw (rows, row_bytes) u8, type, out) → the count of block scales that are not
//   finite (d, and m where the form has one; the caller names the tensor). `type` is the GGML
//   type number; `out` the arrays of the type's `arrays(rows, K)`, contiguous, written in place.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <vector>

#include "types/types.h"

namespace torchllama {

static std::vector<BlockType>& block_types() {
  static std::vector<BlockType> rows;                // filled at static initialization
  return rows;
}

bool register_block_type(const BlockType& type) {
  block_types().push_back(type);
  return true;
}

const BlockType* find_block_type(int64_t ggml) {
  for (const BlockType& t : block_types())
    if (t.ggml == ggml) return &t;
  return nullptr;
}

static int64_t gguf_blocks(const at::Tensor& raw, int64_t type, at::TensorList out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "gguf_blocks: raw must be contiguous (rows, bytes) uint8, got ", raw.sizes());
  const BlockType* t = find_block_type(type);
  TORCH_CHECK(t != nullptr, "gguf_blocks: GGML type ", type, " is not converted here");
  const int64_t rows = raw.size(0), nb = raw.size(1) / t->block_bytes;
  TORCH_CHECK(raw.size(1) % t->block_bytes == 0, "gguf_blocks: a row of ", raw.size(1),
              " bytes is not a whole number of ", t->block_bytes, "-byte ", t->name, " blocks");
  const std::vector<int64_t> width = t->widths(nb * t->weights);   // bytes per row, per array
  TORCH_CHECK(out.size() == width.size(), "gguf_blocks: ", t->name, " takes ", width.size(),
              " arrays, got ", out.size());
  std::vector<uint8_t*> base;
  for (size_t i = 0; i < width.size(); ++i) {
    TORCH_CHECK(out[i].is_contiguous() && out[i].dim() == 2 && out[i].size(0) == rows &&
                out[i].size(1) * int64_t(out[i].element_size()) == width[i],
                "gguf_blocks: output ", i, " must be contiguous (", rows, ", ", width[i],
                " bytes), got ", out[i].sizes(), " of ", out[i].scalar_type());
    base.push_back(static_cast<uint8_t*>(out[i].data_ptr()));
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  std::vector<int64_t> bad(at::get_num_threads() + 1, 0);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t*> at_row(base.size());
    int64_t n = 0;
    for (int64_t r = r0; r < r1; ++r) {
      for (size_t i = 0; i < base.size(); ++i) at_row[i] = base[i] + r * width[i];
      n += t->convert_row(src + r * raw.size(1), nb, at_row.data());
    }
    bad[at::get_thread_num()] += n;
  });
  int64_t total = 0;
  for (int64_t n : bad) total += n;
  return total;
}

// The GGML types converted here, by number (the tests compare them with torchllama.blocks').
static std::vector<int64_t> gguf_block_types() {
  std::vector<int64_t> out;
  for (const BlockType& t : block_types()) out.push_back(t.ggml);
  return out;
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("gguf_blocks(Tensor raw, int type, Tensor(a!)[] out) -> int");
  m.def("gguf_block_types() -> int[]", &torchllama::gguf_block_types);
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("gguf_blocks", &torchllama::gguf_blocks);
}
