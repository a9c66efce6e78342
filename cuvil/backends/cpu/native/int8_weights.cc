// Rows times an int8 weight with one fp32 scale per output column, on AMX's int8 tiles
// (backends/cpu/int8_weights.py), as a dispatcher op: the decode-step GEMM of an int8 artifact.
// A step of a few rows streams every weight from memory once; an int8 weight is half a bf16
// one's bytes, and the tiles read it as it is stored, with no widening.
//
// The rows are written as two int8 digits each: x = s1 * a1 + s2 * a2, a1 = round(x / s1) with
// s1 = max|x| / 127 per row, a2 the same of the remainder x - s1 * a1 (its s2 = max|remainder|
// / 127, at most s1 / 254). The remainder left is at most s2 / 2, about 1.5e-5 of the row's
// largest value: finer than the bf16 rounding a bf16 GEMM gives its rows. Each digit's product
// with the weight is exact in int32 (``tdpbssd``), and the result is
// column scale * (s1 * a1.W + s2 * a2.W), with the bias and residual added in fp32.
//
// The weight is packed in blocks of 16 output columns, grouped by two; within a group, for each
// 64 in features, each block's tile of [16 quads of in features][16 columns][4] (AMX's int8
// layout for the second operand), so a group reads one stream; the in features are padded with
// zeros to a multiple of 64. Threads split the groups; a group's four sum tiles (two blocks, two
// digits) accumulate over the in features for each tile of up to 16 rows.
//
// ``int8_weights_level`` is 5 where the CPU has AMX-INT8 and AVX-512 and Linux grants the
// process the tile state, else 0 (the Python side then widens the weight to bf16 at load).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t COLUMNS = 16;    // output columns of a packed block (one sum tile's width)
constexpr int64_t DEPTH = 64;      // in features one tile product sums over
constexpr int64_t TILE_ROWS = 16;  // rows of one tile of rows
constexpr int64_t GROUP = 2;       // blocks multiplied together
constexpr int64_t TILE = 16 * 64;  // bytes of one weight tile

int64_t level() {
#if defined(__x86_64__)
  static const int64_t found = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return int64_t{0};
    const bool amx = (d >> 24 & 1) && (d >> 25 & 1);  // AMX-TILE and AMX-INT8
    const bool avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
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
  const int8_t *digits;  // [rows][2][depth]: each row's two digits (a1, then a2)
  const float *steps;    // [rows][2]: s1, s2
  const int8_t *packed;  // the weight in tiles (see the top)
  const float *scales;   // [out features]
  const float *bias;     // [out features] or null
  const void *residual;  // [rows][out features] fp32 or bf16, or null
  void *out;             // [rows][out features] fp32 or bf16
  int64_t row_count, depth, out_features;
  bool residual_low, out_low;
};

#if defined(__x86_64__)
#define WIDE "avx512f,avx512bw,avx512vl"  // the vector code around the tiles

// 16 lanes of a row (fp32 or bf16) as fp32, the lanes past ``mask`` zero
__attribute__((target(WIDE))) inline __m512 load_lanes(const float *from, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, from);
}
__attribute__((target(WIDE))) inline __m512 load_lanes(const at::BFloat16 *from, __mmask16 mask) {
  const __m256i half = _mm256_maskz_loadu_epi16(mask, from);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// rows [first, first + count) of x (fp32 or bf16, [rows][in]) as two int8 digits each
template <typename T>
__attribute__((target(WIDE))) void split_rows(const T *x, int64_t in_features, int64_t depth,
                                              int64_t first, int64_t count, int8_t *digits,
                                              float *steps) {
  float remainder[depth];
  for (int64_t r = first; r < first + count; r++) {
    const T *row = x + r * in_features;
    for (int64_t k = 0; k < depth; k += 16) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, in_features - k));
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
      _mm512_storeu_ps(remainder + k, left ? load_lanes(row + k, mask) : _mm512_setzero_ps());
    }
    for (int digit = 0; digit < 2; digit++) {
      __m512 peaks = _mm512_setzero_ps();
      for (int64_t k = 0; k < depth; k += 16)
        peaks = _mm512_max_ps(peaks, _mm512_abs_ps(_mm512_loadu_ps(remainder + k)));
      const float peak = _mm512_reduce_max_ps(peaks);
      const float step = peak / 127, inverse = peak > 0 ? 127 / peak : 0;
      int8_t *to = digits + (r * 2 + digit) * depth;
      for (int64_t k = 0; k < depth; k += 16) {
        const __m512 value = _mm512_loadu_ps(remainder + k);
        const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(value, _mm512_set1_ps(inverse)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(to + k),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
        _mm512_storeu_ps(remainder + k, _mm512_fnmadd_ps(q, _mm512_set1_ps(step), value));
      }
      steps[r * 2 + digit] = step;
    }
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t tile_rows[16] = {};
};

// tiles 0-3: the int32 sums of (block 0, digit 1), (0, 2), (1, 1), (1, 2), rows x 16;
// 4, 5: the rows' first and second digits (rows x 64 int8); 6, 7: the two blocks' weight tiles
__attribute__((target("amx-tile"))) void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; t++) {
    config.bytes_per_row[t] = 64;
    config.tile_rows[t] = t < 6 ? static_cast<uint8_t>(rows) : 16;
  }
  _tile_loadconfig(&config);
}

// one block's digit sums for rows [first, first + rows) (``sums``: [2][16][16] int32, by
// digit): combined, scaled per column, bias and residual added, stored as fp32 or bf16 (the
// last block's padding columns masked off)
__attribute__((target(WIDE))) void finish(const Operands &o, const int32_t *sums, int64_t block,
                                          int64_t first, int64_t rows) {
  const int64_t column = block * COLUMNS;
  const int64_t columns = std::min(COLUMNS, o.out_features - column);
  const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
  const __m512 scale = _mm512_maskz_loadu_ps(mask, o.scales + column);
  const __m512 bias = o.bias ? _mm512_maskz_loadu_ps(mask, o.bias + column) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; r++) {
    const int64_t offset = (first + r) * o.out_features + column;
    const float *step = o.steps + (first + r) * 2;
    const __m512 high = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + r * COLUMNS));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + (TILE_ROWS + r) * COLUMNS));
    const __m512 value = _mm512_fmadd_ps(high, _mm512_set1_ps(step[0]),
                                         _mm512_mul_ps(low, _mm512_set1_ps(step[1])));
    __m512 y = _mm512_fmadd_ps(value, scale, bias);
    if (o.residual && o.residual_low) {
      const __m256i half =
          _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t *>(o.residual) + offset);
      const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
      y = _mm512_add_ps(y, _mm512_castsi512_ps(wide));
    } else if (o.residual) {
      const float *residual = static_cast<const float *>(o.residual) + offset;
      y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, residual));
    }
    if (o.out_low) {  // round to nearest even (the values are finite)
      const __m512i bits = _mm512_castps_si512(y);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
      const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
      _mm256_mask_storeu_epi16(static_cast<uint16_t *>(o.out) + offset, mask, half);
    } else {
      _mm512_mask_storeu_ps(static_cast<float *>(o.out) + offset, mask, y);
    }
  }
}

// blocks [first_block, first_block + G): every tile of rows over them
template <int G>
__attribute__((target("amx-tile,amx-int8," WIDE))) void group(const Operands &o,
                                                                 int64_t first_block,
                                                                 int64_t &configured) {
  alignas(64) int32_t sums[GROUP][2][TILE_ROWS * COLUMNS];
  const int8_t *packed = o.packed + first_block * o.depth * COLUMNS;
  for (int64_t first = 0; first < o.row_count; first += TILE_ROWS) {
    const int64_t rows = std::min(TILE_ROWS, o.row_count - first);
    if (rows != configured) {
      configure(rows);
      configured = rows;
    }
    _tile_zero(0);
    _tile_zero(1);
    if (G > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const int8_t *x = o.digits + first * 2 * o.depth;
    for (int64_t k = 0; k < o.depth; k += DEPTH) {
      const int8_t *w = packed + k / DEPTH * G * TILE;
      _tile_loadd(4, x + k, 2 * o.depth);
      _tile_loadd(5, x + o.depth + k, 2 * o.depth);
      _tile_loadd(6, w, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 5, 6);
      if (G > 1) {
        _tile_loadd(7, w + TILE, 64);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, sums[0][0], 64);
    _tile_stored(1, sums[0][1], 64);
    if (G > 1) {
      _tile_stored(2, sums[1][0], 64);
      _tile_stored(3, sums[1][1], 64);
    }
    for (int j = 0; j < G; j++) finish(o, sums[j][0], first_block + j, first, rows);
  }
}

// the groups [begin, end) of GROUP blocks (the last one may be short)
__attribute__((target("amx-tile"))) void groups(const Operands &o, int64_t begin, int64_t end) {
  const int64_t block_count = (o.out_features + COLUMNS - 1) / COLUMNS;
  int64_t configured = 0;
  for (int64_t g = begin; g < end; g++) {
    const int64_t first_block = g * GROUP;
    if (block_count - first_block >= 2)
      group<2>(o, first_block, configured);
    else
      group<1>(o, first_block, configured);
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
  TORCH_CHECK(level() == 5, "int8 weights: the CPU has no AMX-INT8 tiles");
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
  const at::Tensor rows = x.contiguous();
  at::Tensor digits = at::empty({row_count, 2, depth}, x.options().dtype(at::kChar));
  at::Tensor steps = at::empty({row_count, 2}, x.options().dtype(at::kFloat));
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
#if defined(__x86_64__)
  at::parallel_for(0, row_count, 1, [&](int64_t begin, int64_t end) {
    int8_t *d = static_cast<int8_t *>(digits.data_ptr());
    float *s = steps.data_ptr<float>();
    if (rows.scalar_type() == at::kBFloat16)
      split_rows(rows.data_ptr<at::BFloat16>(), in_features, depth, begin, end - begin, d, s);
    else
      split_rows(rows.data_ptr<float>(), in_features, depth, begin, end - begin, d, s);
  });
  const Operands o{static_cast<const int8_t *>(digits.data_ptr()),
                   steps.data_ptr<float>(),
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
