// fp32 rows times a bf16 weight, computed in fp32 (backends/cpu/bf16_weights.py), as a
// dispatcher op: the GEMM of a bf16 artifact on a CPU whose oneDNN has no bf16 instructions.
// There the other paths widen the weight to fp32 once at load; a decode step of a few rows
// streams every weight from memory, and a bf16 weight is half the bytes.
//
// The weight is packed as [blocks of 32 output columns][in features][32] bf16: one block's
// row for one input feature is one 64-byte line (its columns paired: see ``widen``). The rows
// are transposed per tile (``panel``: a tile's rows for one input feature side by side, its
// whole panel one contiguous run that stays in L1 while the tile reads it; one transposition
// of all the rows, which each tile would read a slice of every line of, measured 10-18 %
// slower from 12 to 64 rows), so a register tile of ROWS rows by 32 columns
// sums over the input features with one widened line (a shift and a mask per pair of vectors)
// and ROWS broadcasts per ROWS * 32 lanes of multiply-adds. Threads split the column blocks,
// and each runs every row tile on its block while the block is in cache. AVX-512 CPUs run
// tiles of up to 8 rows in 16-lane vectors (16 of the 32 vector registers as sums), AVX2 CPUs
// tiles of 2 rows in 8-lane vectors (8 of the 16 registers as sums, 4 for the widened line:
// taller tiles spill and measured slower), and the rows left over run in tiles of 4, 2 and 1.
// Older CPUs are not offered the path (``bf16_weights_level`` is 0).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vector_math.h"

namespace {

constexpr int64_t COLUMNS = 32;  // output columns of a packed block
constexpr int64_t PREFETCH_LINES = 16;
constexpr int64_t WIDE_ROWS = 8;    // the tallest tile of the AVX-512 code
constexpr int64_t NARROW_ROWS = 2;  // and of the AVX2 code

// the register widths the kernel is built for: an AVX-512 vector holds 16 floats, an AVX2 one 8
template <int64_t N>
struct Lanes {
  typedef float Floats __attribute__((vector_size(4 * N)));
  typedef uint32_t Words __attribute__((vector_size(4 * N)));
};

int64_t level() {
#if defined(__x86_64__)
  static const int64_t found = __builtin_cpu_supports("x86-64-v4")   ? 4
                               : __builtin_cpu_supports("x86-64-v3") ? 3
                                                                     : 0;
  return found;
#else
  return 0;
#endif
}

// a packed line's 32 bf16 values widened to fp32 as COLUMNS / N vectors of N columns, in
// column order: the line holds them in pairs (column j in the low half of 32-bit word j, column
// 16 + j in its high half), and a bf16 value is the top half of its fp32, so each vector is one
// shift (columns 0-15) or one mask (columns 16-31) of N words of the line
template <int64_t N>
__attribute__((always_inline)) inline void widen(const uint16_t *line,
                                                 typename Lanes<N>::Floats (&parts)[COLUMNS / N]) {
  constexpr int64_t HALF = COLUMNS / N / 2;
  for (int64_t h = 0; h < HALF; h++) {
    typename Lanes<N>::Words words;
    std::memcpy(&words, line + 2 * N * h, sizeof words);
    const typename Lanes<N>::Words shifted = words << 16, masked = words & 0xFFFF0000u;
    std::memcpy(&parts[h], &shifted, sizeof shifted);
    std::memcpy(&parts[HALF + h], &masked, sizeof masked);
  }
}

struct Operands {
  const float *panels;     // each tile's rows transposed: [in features][its rows] (``panel``)
  const uint16_t *packed;  // [blocks][in features][COLUMNS]
  const float *bias;       // [out features] or null
  const float *residual;   // [rows][out features] or null
  float *out;              // [rows][out features]
  int64_t rows, in_features, out_features;
};

// one register tile: rows [first, first + ROWS) by the block's 32 columns, in vectors of N
template <int64_t N, int64_t ROWS>
__attribute__((always_inline)) inline void tile(const Operands &o, int64_t block,
                                                int64_t first) {
  typedef typename Lanes<N>::Floats Floats;
  constexpr int64_t PARTS = COLUMNS / N;
  const float *x = o.panels + first * o.in_features;
  const uint16_t *w = o.packed + block * o.in_features * COLUMNS;
  Floats sums[ROWS][PARTS] = {};
  for (int64_t k = 0; k < o.in_features; k++, x += ROWS, w += COLUMNS) {
    if (ROWS <= 2) __builtin_prefetch(w + PREFETCH_LINES * COLUMNS);
    Floats parts[PARTS];
    widen<N>(w, parts);
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; r++) {
#pragma GCC unroll 4
      for (int64_t p = 0; p < PARTS; p++) sums[r][p] += x[r] * parts[p];
    }
  }
  const int64_t column = block * COLUMNS;
  const int64_t columns = std::min(COLUMNS, o.out_features - column);
  float lanes[COLUMNS] = {};  // a short block's padding columns add zeros
  for (int64_t r = 0; r < ROWS; r++) {
    const int64_t offset = (first + r) * o.out_features + column;
    if (o.bias) {
      std::memcpy(lanes, o.bias + column, sizeof(float) * columns);
      for (int64_t p = 0; p < PARTS; p++) sums[r][p] += load_vector<Floats>(lanes + N * p);
    }
    if (o.residual) {
      std::memcpy(lanes, o.residual + offset, sizeof(float) * columns);
      for (int64_t p = 0; p < PARTS; p++) sums[r][p] += load_vector<Floats>(lanes + N * p);
    }
    if (columns == COLUMNS) {
      for (int64_t p = 0; p < PARTS; p++) store_vector(o.out + offset + N * p, sums[r][p]);
    } else {  // the last block's columns past out_features are padding
      for (int64_t p = 0; p < PARTS; p++) store_vector(lanes + N * p, sums[r][p]);
      std::memcpy(o.out + offset, lanes, sizeof(float) * columns);
    }
  }
}

// the row tiles of ``rows`` rows, as (first row, rows): ``most`` at a time, then 4, 2 and 1 for
// the rest, so that a step of one row does one row's arithmetic (it is bounded by reading the
// weight)
template <typename Visit>
__attribute__((always_inline)) inline void for_each_tile(int64_t rows, int64_t most,
                                                         Visit visit) {
  int64_t first = 0;
  for (; first + most <= rows; first += most) visit(first, most);
  for (int64_t size : {int64_t{4}, int64_t{2}}) {
    if (most > size && first + size <= rows) {
      visit(first, size);
      first += size;
    }
  }
  if (first < rows) visit(first, 1);
}

// every row tile of blocks [begin, end)
template <int64_t N, int64_t MOST>
__attribute__((always_inline)) inline void blocks(const Operands &o, int64_t begin, int64_t end) {
  for (int64_t block = begin; block < end; block++) {
    // inlined, as ``tile``, so that it is compiled for the caller's ISA
    for_each_tile(o.rows, MOST, [&](int64_t first, int64_t size) __attribute__((always_inline)) {
      if (size == MOST)
        tile<N, MOST>(o, block, first);
      else if (size == 4)
        tile<N, 4>(o, block, first);
      else if (size == 2)
        tile<N, 2>(o, block, first);
      else
        tile<N, 1>(o, block, first);
    });
  }
}

// x [rows, in] as the tiles read it: tile (first, size) at ``first * in``, [in][size], so each
// tile's rows for one input feature sit side by side and its panel is one contiguous run
at::Tensor panel(const at::Tensor &x, int64_t most) {
  const int64_t rows = x.size(0), in_features = x.size(1);
  at::Tensor panels = at::empty({rows * in_features}, x.options());
  const float *from = x.data_ptr<float>();
  float *to = panels.data_ptr<float>();
  for_each_tile(rows, most, [&](int64_t first, int64_t size) {
    float *into = to + first * in_features;
    for (int64_t r = 0; r < size; r++) {
      const float *row = from + (first + r) * in_features;
      for (int64_t k = 0; k < in_features; k++) into[k * size + r] = row[k];
    }
  });
  return panels;
}

#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) void wide_blocks(const Operands &o, int64_t begin,
                                                           int64_t end) {
  blocks<16, WIDE_ROWS>(o, begin, end);
}

__attribute__((target("arch=x86-64-v3"))) void narrow_blocks(const Operands &o, int64_t begin,
                                                             int64_t end) {
  blocks<8, NARROW_ROWS>(o, begin, end);
}
#endif

int64_t bf16_weights_level() { return level(); }

// x [rows, in] fp32 times the packed weight, + bias, + residual [rows, out], with the code
// for ISA level ``isa`` (4: AVX-512, 3: AVX2; at most the CPU's: a test runs either)
at::Tensor bf16_weight_linear(const at::Tensor &x, const at::Tensor &packed, int64_t out_features,
                              const std::optional<at::Tensor> &bias,
                              const std::optional<at::Tensor> &residual, int64_t isa) {
  TORCH_CHECK(level() > 0, "bf16 weights: the CPU has neither AVX2 nor AVX-512");
  TORCH_CHECK(isa == 3 || isa == 4, "bf16 weights: ISA level 3 or 4, not ", isa);
  TORCH_CHECK(isa <= level(), "bf16 weights: this CPU's ISA level is ", level());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "bf16 weights: fp32 rows expected");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t block_count = (out_features + COLUMNS - 1) / COLUMNS;
  TORCH_CHECK(packed.is_contiguous() && packed.element_size() == 2 &&
                  packed.numel() == block_count * in_features * COLUMNS,
              "bf16 weights: the packed weight does not match the rows");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  const at::Tensor panels = panel(x.contiguous(), isa == 4 ? WIDE_ROWS : NARROW_ROWS);
  at::Tensor b, r;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out_features, "bf16 weights: bias size");
  }
  if (residual.has_value() && residual->defined()) {
    r = residual->to(at::kFloat).contiguous();
    TORCH_CHECK(r.numel() == rows * out_features, "bf16 weights: residual shape");
  }
  const Operands o{panels.data_ptr<float>(),
                   static_cast<const uint16_t *>(packed.data_ptr()),
                   b.defined() ? b.data_ptr<float>() : nullptr,
                   r.defined() ? r.data_ptr<float>() : nullptr,
                   out.data_ptr<float>(),
                   rows,
                   in_features,
                   out_features};
#if defined(__x86_64__)
  at::parallel_for(0, block_count, 1, [&](int64_t begin, int64_t end) {
    if (isa == 4)
      wide_blocks(o, begin, end);
    else
      narrow_blocks(o, begin, end);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def("bf16_weights_level() -> int", bf16_weights_level);
  m.def(
      "bf16_weight_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
      "Tensor? residual, int isa) -> Tensor",
      bf16_weight_linear);
}
