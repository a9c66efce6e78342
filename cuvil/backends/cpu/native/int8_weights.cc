// Rows times an int8 weight with one fp32 scale per output column, computed in bf16 on AMX
// tiles (backends/cpu/int8_weights.py), as a dispatcher op: the GEMM of an int8 artifact.
// A decode step of a few rows streams every weight from memory once; an int8 weight is half a
// bf16 one's bytes, and AMX makes the arithmetic of up to 16 rows nearly free, so the step is
// bounded by reading the int8 weight and widening it.
//
// The weight is packed in blocks of 16 output columns as [blocks][in features / 2][16][2]
// (pairs of input features side by side per column: AMX's bf16 layout for the second operand,
// ``tdpbf16ps`` multiplies pairs), the in features padded with zeros to a multiple of 32. Each
// thread takes a run of blocks; for each block it widens the int8 values to bf16 once into a
// buffer that stays in L1/L2 (the values are integers up to 127 in magnitude, exact in bf16),
// then runs every tile of up to 16 rows over it: a 16 x 16 fp32 sum tile accumulating
// ``rows x 32`` by ``32 x 16`` products. The rows are read as bf16 (fp32 rows are rounded to
// bf16 first, as a bf16 GEMM does). The sums are scaled per column and the bias and residual
// added in fp32; the result is fp32 or bf16.
//
// ``int8_weights_level`` is 5 where the CPU has AMX-BF16 and Linux grants the process the
// tile state, else 0 (the Python side then widens the weight to bf16 at load).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t COLUMNS = 16;  // output columns of a packed block (one sum tile's width)
constexpr int64_t DEPTH = 32;    // in features one tile product sums over
constexpr int64_t TILE_ROWS = 16;

int64_t level() {
#if defined(__x86_64__)
  static const int64_t found = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return int64_t{0};
    const bool amx = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16 and AMX-TILE
    const bool avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
    if (!amx || !avx512) return int64_t{0};
    // Linux hands out the tile registers' state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    constexpr long REQUEST_PERMISSION = 0x1023, TILE_DATA = 18;
    if (syscall(SYS_arch_prctl, REQUEST_PERMISSION, TILE_DATA) != 0) return int64_t{0};
    return int64_t{5};
  }();
  return found;
#else
  return 0;
#endif
}

struct Operands {
  const uint16_t *rows;  // [rows][depth] bf16, the in features padded to ``depth``
  const int8_t *packed;  // [blocks][depth / 2][COLUMNS][2]
  const float *scales;   // [out features]
  const float *bias;     // [out features] or null
  const void *residual;  // [rows][out features] fp32 or bf16, or null
  void *out;             // [rows][out features] fp32 or bf16
  int64_t row_count, depth, out_features;
  bool residual_low, out_low;
};

#if defined(__x86_64__)
#define WIDE "avx512f,avx512bw,avx512vl,avx512bf16"  // the vector code around the tiles

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t tile_rows[16] = {};
};

// tiles: 0-3 the sums of up to four blocks (rows x 16 fp32), 4 the rows (rows x 32 bf16),
// 5-7 the widened weight of a block (16 pairs of in features x 16 columns, bf16)
__attribute__((target("amx-tile"))) void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; t++) {
    config.bytes_per_row[t] = 64;
    config.tile_rows[t] = t < 5 ? static_cast<uint8_t>(rows) : 16;
  }
  _tile_loadconfig(&config);
}

// ``count`` int8 values (a multiple of 32) as bf16, in order
__attribute__((target(WIDE))) inline void widen(const int8_t *from,
                                                                           uint16_t *to,
                                                                           int64_t count) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512 low = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(from + i))));
    const __m512 high = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(from + i + 16))));
    _mm512_storeu_si512(to + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
}

// one block's sums for rows [first, first + rows) (``sums``: [16][16]), scaled per column,
// bias and residual added, stored as fp32 or bf16 (the last block's padding columns masked off)
__attribute__((target(WIDE))) void finish(const Operands &o,
                                                                     const float *sums,
                                                                     int64_t block, int64_t first,
                                                                     int64_t rows) {
  const int64_t column = block * COLUMNS;
  const int64_t columns = std::min(COLUMNS, o.out_features - column);
  const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
  const __m512 scale = _mm512_maskz_loadu_ps(mask, o.scales + column);
  const __m512 bias = o.bias ? _mm512_maskz_loadu_ps(mask, o.bias + column) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; r++) {
    const int64_t offset = (first + r) * o.out_features + column;
    __m512 y = _mm512_fmadd_ps(_mm512_loadu_ps(sums + r * COLUMNS), scale, bias);
    if (o.residual && o.residual_low) {
      const __m256i half = _mm256_maskz_loadu_epi16(
          mask, static_cast<const uint16_t *>(o.residual) + offset);
      y = _mm512_add_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
    } else if (o.residual) {
      y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, static_cast<const float *>(o.residual) + offset));
    }
    if (o.out_low)
      _mm256_mask_storeu_epi16(static_cast<uint16_t *>(o.out) + offset, mask,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    else
      _mm512_mask_storeu_ps(static_cast<float *>(o.out) + offset, mask, y);
  }
}

constexpr int64_t GROUP = 4;          // blocks multiplied together, one sum tile each
constexpr int64_t TILE = 16 * DEPTH;  // bf16 values of one widened weight tile

// blocks [first_block, first_block + G): every row tile over them, the weight widened into
// ``wide`` ([depth / 32][G][TILE]) during the first row tile and reused by the others; four
// independent sum tiles keep the tile unit busy while one product's result is pending
template <int G>
__attribute__((target("amx-tile,amx-bf16," WIDE))) void group(
    const Operands &o, int64_t first_block, uint16_t *wide, int64_t &configured) {
  alignas(64) float sums[GROUP][TILE_ROWS * COLUMNS];
  const int8_t *packed = o.packed + first_block * o.depth * COLUMNS;
  for (int64_t first = 0; first < o.row_count; first += TILE_ROWS) {
    const int64_t rows = std::min(TILE_ROWS, o.row_count - first);
    if (rows != configured) {
      configure(rows);
      configured = rows;
    }
    _tile_zero(0);
    if (G > 1) _tile_zero(1);
    if (G > 2) _tile_zero(2);
    if (G > 3) _tile_zero(3);
    const uint16_t *x = o.rows + first * o.depth;
    if (first == 0) widen(packed, wide, G * TILE);
    for (int64_t k = 0; k < o.depth; k += DEPTH) {
      uint16_t *b = wide + k / DEPTH * G * TILE;
      // the next step's weight is widened while the tile unit multiplies this one's
      if (first == 0 && k + DEPTH < o.depth) widen(packed + (k / DEPTH + 1) * G * TILE, b + G * TILE, G * TILE);
      _tile_loadd(4, x + k, o.depth * 2);
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (G > 1) {
        _tile_loadd(6, b + TILE, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (G > 2) {
        _tile_loadd(7, b + 2 * TILE, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (G > 3) {
        _tile_loadd(5, b + 3 * TILE, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, sums[0], 64);
    if (G > 1) _tile_stored(1, sums[1], 64);
    if (G > 2) _tile_stored(2, sums[2], 64);
    if (G > 3) _tile_stored(3, sums[3], 64);
    for (int j = 0; j < G; j++) finish(o, sums[j], first_block + j, first, rows);
  }
}

// the groups [begin, end) of GROUP blocks (the last one may be short)
__attribute__((target("amx-tile"))) void groups(const Operands &o, int64_t begin, int64_t end) {
  const int64_t block_count = (o.out_features + COLUMNS - 1) / COLUMNS;
  std::vector<uint16_t> wide(o.depth / DEPTH * GROUP * TILE);
  int64_t configured = 0;
  for (int64_t g = begin; g < end; g++) {
    const int64_t first_block = g * GROUP;
    switch (std::min(GROUP, block_count - first_block)) {
      case 4: group<4>(o, first_block, wide.data(), configured); break;
      case 3: group<3>(o, first_block, wide.data(), configured); break;
      case 2: group<2>(o, first_block, wide.data(), configured); break;
      default: group<1>(o, first_block, wide.data(), configured); break;
    }
  }
  if (configured) _tile_release();
}
#endif

int64_t int8_weights_level() { return level(); }

// x [rows, in] (fp32 or bf16) times the packed int8 weight scaled per column, + bias,
// + residual [rows, out]; the result bf16 where ``low_out``, else fp32
at::Tensor int8_weight_linear(const at::Tensor &x, const at::Tensor &packed,
                              const at::Tensor &scales, int64_t out_features,
                              const std::optional<at::Tensor> &bias,
                              const std::optional<at::Tensor> &residual, bool low_out) {
  TORCH_CHECK(level() == 5, "int8 weights: the CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2, "int8 weights: rows [rows, in] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8 weights: fp32 or bf16 rows expected");
  const int64_t row_count = x.size(0), in_features = x.size(1);
  const int64_t depth = (in_features + DEPTH - 1) / DEPTH * DEPTH;
  const int64_t block_count = (out_features + COLUMNS - 1) / COLUMNS;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.numel() == block_count * depth * COLUMNS,
              "int8 weights: the packed weight does not match the rows");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == out_features,
              "int8 weights: one fp32 scale per output column expected");
  const auto out_type = low_out ? at::kBFloat16 : at::kFloat;
  at::Tensor out = at::empty({row_count, out_features}, x.options().dtype(out_type));
  if (row_count == 0 || out_features == 0) return out;
  at::Tensor rows = x.to(at::kBFloat16).contiguous();
  if (depth != in_features) rows = at::constant_pad_nd(rows, {0, depth - in_features});
  at::Tensor b, r;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out_features, "int8 weights: bias size");
  }
  if (residual.has_value() && residual->defined()) {
    r = residual->scalar_type() == at::kBFloat16 ? residual->contiguous()
                                                 : residual->to(at::kFloat).contiguous();
    TORCH_CHECK(r.numel() == row_count * out_features, "int8 weights: residual shape");
  }
  const Operands o{static_cast<const uint16_t *>(rows.data_ptr()),
                   static_cast<const int8_t *>(packed.data_ptr()),
                   scales.data_ptr<float>(),
                   b.defined() ? b.data_ptr<float>() : nullptr,
                   r.defined() ? r.data_ptr() : nullptr,
                   out.data_ptr(),
                   row_count,
                   depth,
                   out_features,
                   r.defined() && r.scalar_type() == at::kBFloat16,
                   low_out};
#if defined(__x86_64__)
  const int64_t group_count = (block_count + GROUP - 1) / GROUP;
  at::parallel_for(0, group_count, 1, [&](int64_t begin, int64_t end) { groups(o, begin, end); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def("int8_weights_level() -> int", int8_weights_level);
  m.def(
      "int8_weight_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias, "
      "Tensor? residual, bool low_out) -> Tensor",
      int8_weight_linear);
}
