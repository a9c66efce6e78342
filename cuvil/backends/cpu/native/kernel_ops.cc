// Cuvil's own kernels as dispatcher ops, so the native plan loop (plan_loop.cc) calls them like
// any ATen op: the C kernels of rowwise.c, winograd.c and pooling.c (each built for this CPU and loaded by
// ctypes; the op is handed the function's address), SwiGLU's gating, and the KV-cache ops of
// decoder generation (cuvil/backends/kv_cache.py's ATen calls, here without Python between).
//
// Each op takes what its Python kernel takes and answers as it does, falling back to the same
// ATen computation for inputs its C kernel does not take (not fp32, last dim not contiguous).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "block_attention.h"
#include "vector_math.h"

namespace {

using RmsNorm = void (*)(const float *, int64_t, int64_t, int64_t, const float *, float, float *,
                         int);
using Rope = void (*)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t,
                      int64_t, const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t, float *, int);
// fp32 or bf16 elements, by the kernel (pooling.c)
using MaxPool = void (*)(const void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, void *, int);
using WinogradInput = void (*)(const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, float *, int);
using WinogradOutput = void (*)(const float *, const float *, const float *, float *, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int);

bool fits(const at::Tensor &t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() > 0 && t.stride(-1) == 1;
}

at::Tensor rms_norm(int64_t kernel, const at::Tensor &x, const at::Tensor &weight, double eps) {
  const int64_t width = weight.size(-1);
  if (!fits(x) || x.size(-1) != width) return at::rms_norm(x, {width}, weight, eps);
  at::Tensor rows = x.is_contiguous() ? x : x.reshape({-1, width});
  const int64_t stride = x.is_contiguous() ? width : rows.stride(0);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t count = x.numel() / std::max<int64_t>(width, 1);
  if (count)
    reinterpret_cast<RmsNorm>(kernel)(rows.data_ptr<float>(), count, width, stride,
                                      weight.data_ptr<float>(), static_cast<float>(eps),
                                      out.data_ptr<float>(), at::get_num_threads());
  return out;
}

at::Tensor rope_with_aten(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return at::addcmul(x * cos, rotated, sin);
}

// strides of t broadcast to x's 4-D shape, first three dims; false if it does not broadcast
bool leading_strides(const at::Tensor &t, at::IntArrayRef shape, int64_t out[3]) {
  if (t.dim() > 4 || t.size(-1) != shape[3]) return false;
  const int64_t pad = 4 - t.dim();
  for (int64_t d = 0; d < 3; d++) {
    if (d < pad) {
      out[d] = 0;
      continue;
    }
    const int64_t size = t.size(d - pad), wanted = shape[d];
    if (size == wanted && wanted != 1)
      out[d] = t.stride(d - pad);
    else if (size == 1)
      out[d] = 0;
    else
      return false;
  }
  return true;
}

at::Tensor rope(int64_t kernel, const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
  if (x.dim() != 4 || x.size(-1) % 2 || !fits(x) || !fits(cos) || !fits(sin))
    return rope_with_aten(x, cos, sin);
  int64_t cs[3], ss[3];
  if (!leading_strides(cos, x.sizes(), cs) || !leading_strides(sin, x.sizes(), ss))
    return rope_with_aten(x, cos, sin);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel())
    reinterpret_cast<Rope>(kernel)(x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2),
                                   cos.data_ptr<float>(), cs[0], cs[1], cs[2],
                                   sin.data_ptr<float>(), ss[0], ss[1], ss[2], x.size(0),
                                   x.size(1), x.size(2), x.size(3), out.data_ptr<float>(),
                                   at::get_num_threads());
  return out;
}

// pooling.py's max_pool2d(): window = kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w
// [, the bf16 kernel]; ATen's op for what the C kernels do not take (not channels-last fp32 or
// bf16, padding over half a window, an empty result), so its errors are ATen's
at::Tensor max_pool2d(int64_t kernel, const at::Tensor &x, std::vector<int64_t> window) {
  const int64_t kh = window.at(0), kw = window.at(1), sh = window.at(2), sw = window.at(3);
  const int64_t ph = window.at(4), pw = window.at(5);
  auto with_aten = [&] { return at::max_pool2d(x, {kh, kw}, {sh, sw}, {ph, pw}); };
  // window[6], where given: the kernel for bf16 maps (its fp32 one is `kernel`)
  const int64_t low_kernel = window.size() > 6 ? window.at(6) : 0;
  const bool low = x.scalar_type() == at::kBFloat16 && low_kernel != 0;
  if (x.dim() != 4 || (x.scalar_type() != at::kFloat && !low) || !x.device().is_cpu() ||
      !x.is_contiguous(at::MemoryFormat::ChannelsLast) || x.numel() == 0 ||
      2 * std::max(ph, pw) > std::min(kh, kw))
    return with_aten();
  const int64_t batch = x.size(0), channels = x.size(1), height = x.size(2), width = x.size(3);
  const int64_t out_h = (height + 2 * ph - kh) / sh + 1, out_w = (width + 2 * pw - kw) / sw + 1;
  if (out_h <= 0 || out_w <= 0) return with_aten();
  at::Tensor out = at::empty({batch, channels, out_h, out_w},
                             x.options().memory_format(at::MemoryFormat::ChannelsLast));
  reinterpret_cast<MaxPool>(low ? low_kernel : kernel)(
      x.data_ptr(), batch, height, width, channels, kh, kw, sh, sw, ph, pw, out_h, out_w,
      out.data_ptr(), at::get_num_threads());
  return out;
}

at::Tensor silu_mul_fp32(const at::Tensor &projected, int64_t hidden);

// SwiGLU's gating on the packed GEMM result [..., 2 * hidden]: silu(gate) * up, in one pass
// over fp32 rows (ATen's silu on the gate's strided half, then the product, took several times
// as long in a decode step); other dtypes through ATen
at::Tensor silu_mul(const at::Tensor &projected, int64_t hidden) {
  if (projected.scalar_type() == at::kFloat && projected.dim() >= 1 &&
      projected.size(-1) == 2 * hidden && projected.is_contiguous())
    return silu_mul_fp32(projected, hidden);
  return at::silu(projected.narrow(-1, 0, hidden)).mul_(projected.narrow(-1, hidden, hidden));
}

// this thread's buffer `which`, grown as needed (winograd.py's workspace())
at::Tensor workspace(int which, int64_t floats) {
  thread_local at::Tensor buffers[2];
  at::Tensor &buffer = buffers[which];
  if (!buffer.defined() || buffer.numel() < floats) {
    c10::InferenceMode normal(false);  // bmm writes into it in place, in or out of that mode
    buffer = at::empty({floats}, at::kFloat);
  }
  return buffer;
}

// winograd.py's WinogradConv.__call__: geometry = pad_top, pad_left, fused activation,
// tiles per chunk, chunk floats; the activation the output transform does not fuse follows
at::Tensor winograd(int64_t input_kernel, int64_t output_kernel, const at::Tensor &input,
                    const at::Tensor &transformed, const std::optional<at::Tensor> &bias,
                    const std::optional<at::Tensor> &residual_in, std::vector<int64_t> geometry,
                    bool donated) {
  const int64_t pad_h = geometry.at(0), pad_w = geometry.at(1);
  int fused = static_cast<int>(geometry.at(2));
  const int64_t per_chunk = geometry.at(3), chunk_floats = geometry.at(4);
  at::Tensor x = input.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t batch = x.size(0), channels = x.size(1), height = x.size(2), width = x.size(3);
  const int64_t out_channels = transformed.size(2);
  const int64_t out_h = height + 2 * pad_h - 2, out_w = width + 2 * pad_w - 2;
  const int64_t tiles_h = (out_h + 3) / 4, tiles_w = (out_w + 3) / 4;
  const int64_t tiles = batch * tiles_h * tiles_w;
  std::vector<int64_t> shape = {batch, out_channels, out_h, out_w};
  at::Tensor residual;
  bool broadcast = false;
  if (residual_in.has_value() && residual_in->defined()) {
    residual = *residual_in;
    broadcast = residual.sizes() != at::IntArrayRef(shape);
    if (broadcast) fused = 0;
    if (!broadcast) residual = residual.contiguous(at::MemoryFormat::ChannelsLast);
  }
  at::Tensor out = donated && residual.defined() && !broadcast
                       ? residual
                       : at::empty(shape, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const float *added = residual.defined() && !broadcast ? residual.data_ptr<float>() : nullptr;
  const float *bias_data = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const int threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(
      1, std::min(per_chunk, chunk_floats / (36 * std::max(channels, out_channels))));
  for (int64_t first = 0; first < tiles; first += chunk) {
    const int64_t count = std::min(chunk, tiles - first);
    at::Tensor tiled = workspace(0, 36 * count * channels).narrow(0, 0, 36 * count * channels)
                           .view({36, count, channels});
    reinterpret_cast<WinogradInput>(input_kernel)(x.data_ptr<float>(), height, width, channels,
                                                  pad_h, pad_w, tiles_h, tiles_w, first, count,
                                                  tiled.data_ptr<float>(), threads);
    at::Tensor products = workspace(1, 36 * count * out_channels)
                              .narrow(0, 0, 36 * count * out_channels)
                              .view({36, count, out_channels});
    at::bmm_out(products, tiled, transformed);
    reinterpret_cast<WinogradOutput>(output_kernel)(products.data_ptr<float>(), bias_data, added,
                                                    out.data_ptr<float>(), out_h, out_w,
                                                    out_channels, tiles_h, tiles_w, first, count,
                                                    fused, threads);
  }
  if (broadcast) out.add_(residual);
  return out;
}

// the write as copies, one per (row, KV head, token) of head_dim elements, when every slot and
// position lies inside the cache: a decode step writes a few hundred bytes, and index_put_ spent
// 10-17 us building and checking its index tensors for that. False (nothing written) for what
// it does not take (another dtype or layout, an index to wrap or refuse): index_put_ does that.
bool copy_into_slots(at::Tensor &cache, const at::Tensor &fresh, const at::Tensor &slots,
                     const at::Tensor &positions) {
  if (!cache.device().is_cpu() || !fresh.device().is_cpu() || cache.dim() != 4 ||
      fresh.dim() != 4 || cache.scalar_type() != fresh.scalar_type() || cache.stride(3) != 1 ||
      fresh.stride(3) != 1 || slots.scalar_type() != at::kLong ||
      positions.scalar_type() != at::kLong || slots.dim() != 1 || positions.dim() != 1 ||
      fresh.is_alias_of(cache))
    return false;
  const int64_t batch = fresh.size(0), heads = fresh.size(1), tokens = fresh.size(2);
  const int64_t dim = fresh.size(3);
  if (slots.numel() != batch || positions.numel() != batch || cache.size(1) != heads ||
      cache.size(3) != dim)
    return false;
  const at::Tensor slots_c = slots.contiguous(), starts_c = positions.contiguous();
  const int64_t *slot = slots_c.data_ptr<int64_t>(), *start = starts_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; b++)
    if (slot[b] < 0 || slot[b] >= cache.size(0) || start[b] < 0 ||
        start[b] + tokens > cache.size(2))
      return false;
  const int64_t item = cache.element_size();
  char *to = static_cast<char *>(cache.data_ptr());
  const char *from = static_cast<const char *>(fresh.data_ptr());
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1), cs2 = cache.stride(2);
  const int64_t fs0 = fresh.stride(0), fs1 = fresh.stride(1), fs2 = fresh.stride(2);
  for (int64_t b = 0; b < batch; b++)
    for (int64_t h = 0; h < heads; h++)
      for (int64_t t = 0; t < tokens; t++)
        std::memcpy(to + (slot[b] * cs0 + h * cs1 + (start[b] + t) * cs2) * item,
                    from + (b * fs0 + h * fs1 + t * fs2) * item, dim * item);
  if (!cache.is_inference()) cache.unsafeGetTensorImpl()->bump_version();  // as index_put_ does
  return true;
}

// kv_cache.py's write(): new [batch, kv_heads, tokens, head_dim] into cache at each row's slot
at::Tensor &kv_cache_write(at::Tensor &cache, const at::Tensor &fresh, const at::Tensor &slots,
                           const at::Tensor &positions) {
  if (copy_into_slots(cache, fresh, slots, positions)) return cache;
  at::Tensor by_position = cache.transpose(1, 2);
  const int64_t tokens = fresh.size(2);
  if (tokens == 1) {
    by_position.index_put_(c10::List<std::optional<at::Tensor>>({slots, positions}),
                           fresh.select(2, 0));
    return cache;
  }
  at::Tensor where = positions.unsqueeze(1) + at::arange(tokens, positions.options());
  by_position.index_put_(c10::List<std::optional<at::Tensor>>({slots.unsqueeze(1), where}),
                         fresh.transpose(1, 2));
  return cache;
}

// eight fp32 lanes: AVX registers in the x86-64-v3 clone below, SSE pairs in the baseline one
typedef float Lanes __attribute__((vector_size(32)));

__attribute__((always_inline)) inline Lanes load_lanes(const float *from) {
  return load_vector<Lanes>(from);
}

__attribute__((always_inline)) inline void store_lanes(float *to, Lanes lanes) {
  store_vector(to, lanes);
}

#if defined(__x86_64__)
#define CUVIL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CUVIL_CLONES
#endif

typedef int32_t IntLanes __attribute__((vector_size(32)));

// exp of eight lanes at or below zero (vector_math.h)
__attribute__((always_inline)) inline Lanes exp_lanes(Lanes x) {
  return exp_at_most_zero<Lanes, IntLanes>(x);
}

// silu(gate) * up for ``count`` values: gate * sigmoid(gate), the sigmoid from e = exp(-|gate|)
// (at most 1, so it never overflows): 1 / (1 + e) for a positive gate, e / (1 + e) otherwise
CUVIL_CLONES void silu_mul_values(const float *gate, const float *up, float *out,
                                  int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const Lanes g = load_lanes(gate + i);
    const Lanes e = exp_lanes(g > 0 ? -g : g);
    const Lanes sigmoid = (g > 0 ? Lanes{} + 1.0f : e) / (1.0f + e);
    store_lanes(out + i, g * sigmoid * load_lanes(up + i));
  }
  for (; i < count; i++) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

at::Tensor silu_mul_fp32(const at::Tensor &projected, int64_t hidden) {
  std::vector<int64_t> sizes = projected.sizes().vec();
  sizes.back() = hidden;
  at::Tensor out = at::empty(sizes, projected.options());
  const int64_t rows = hidden ? projected.numel() / (2 * hidden) : 0;
  const float *from = projected.data_ptr<float>();
  float *to = out.data_ptr<float>();
  // rows per thread: a decode step's few rows run on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, hidden));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      silu_mul_values(from + 2 * r * hidden, from + (2 * r + 1) * hidden, to + r * hidden, hidden);
  });
  return out;
}

// the sum of eight lanes, pairwise
__attribute__((always_inline)) inline float lane_sum(Lanes lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// value rows weighed per pass over a KV head's values (a tile of 128 rows of 64 floats: 32 KB)
constexpr int64_t VALUE_TILE = 128;

// the sums of eight lanes' vectors, as one vector: lane j holds the sum of ``lanes[j]``'s lanes
__attribute__((always_inline)) inline Lanes sum_each(const Lanes lanes[8]) {
  const IntLanes low_pairs = {0, 1, 8, 9, 4, 5, 12, 13}, high_pairs = {2, 3, 10, 11, 6, 7, 14, 15};
  const IntLanes evens = {0, 8, 2, 10, 4, 12, 6, 14}, odds = {1, 9, 3, 11, 5, 13, 7, 15};
  const IntLanes lows = {0, 1, 2, 3, 8, 9, 10, 11}, highs = {4, 5, 6, 7, 12, 13, 14, 15};
  Lanes pairs[4], quads[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++)
    pairs[i] = __builtin_shuffle(lanes[2 * i], lanes[2 * i + 1], low_pairs) +
               __builtin_shuffle(lanes[2 * i], lanes[2 * i + 1], high_pairs);
#pragma GCC unroll 2
  for (int i = 0; i < 2; i++)
    quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], evens) +
               __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], odds);
  const Lanes sums = __builtin_shuffle(quads[0], quads[1], lows) +
                     __builtin_shuffle(quads[0], quads[1], highs);  // lanes 0 2 1 3 4 6 5 7
  return __builtin_shuffle(sums, IntLanes{0, 2, 1, 3, 4, 6, 5, 7});
}

// ``scores[t] = factor * (query . keys[t])`` for eight keys from ``keys`` (``dim`` a multiple
// of eight): eight dot products summed across lanes together, not one by one
__attribute__((always_inline)) inline Lanes eight_scores(const float *query, const float *keys,
                                                         int64_t key_stride, int64_t dim,
                                                         float factor) {
  Lanes sums[8] = {};
  for (int64_t d = 0; d < dim; d += 8) {
    const Lanes q = load_lanes(query + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) sums[j] += q * load_lanes(keys + j * key_stride + d);
  }
  return sum_each(sums) * factor;
}

// ``out += sum over t of weights[t] * values[t]`` for ``Blocks`` * 8 columns from ``column``,
// the columns held in registers across the ``length`` rows
template <int Blocks>
__attribute__((always_inline)) inline void weigh_columns(const float *weights, float scale,
                                                         const float *values, int64_t stride,
                                                         int64_t length, int64_t column,
                                                         float *out) {
  Lanes sums[Blocks] = {};
  for (int64_t t = 0; t < length; t++) {
    const Lanes weight = Lanes{} + weights[t] * scale;
    const float *row = values + t * stride + column;
#pragma GCC unroll 8
    for (int b = 0; b < Blocks; b++) sums[b] += weight * load_lanes(row + 8 * b);
  }
#pragma GCC unroll 8
  for (int b = 0; b < Blocks; b++)
    store_lanes(out + column + 8 * b, load_lanes(out + column + 8 * b) + sums[b]);
}

// the attention of ``group`` query heads that share one KV head (GQA; 1 without it) over
// ``length`` cached positions: scores (scaled q . k), softmax, the weighted sum of values into
// ``out`` (``group`` rows of ``dim``), eight lanes at a time. The scores are computed key row
// by key row for the whole group, so each key is read from memory once however many query
// heads share it (at long lengths a head's keys outgrow the L2 cache); each query head's
// output columns then sum in registers over the value rows. Built twice (AVX2 with FMA, and
// the baseline), the loader picking the one this CPU runs, so one build serves every x86 CPU.
// ``scores`` holds ``group * length`` floats.
CUVIL_CLONES void attend_group(const float *q, int64_t group, const float *keys,
                               int64_t key_stride, const float *values, int64_t value_stride,
                               int64_t length, int64_t dim, float factor, float *scores,
                               float *out) {
  const int64_t whole = dim - dim % 8, blocks = length - length % 8;
  const int64_t by_eight = dim % 8 == 0 ? blocks : 0;  // keys scored eight at a time
  std::vector<float> tops(group, -INFINITY), scales(group);  // each head's max, 1 / its sum
  for (int64_t t = 0; t < by_eight; t += 8)
    for (int64_t g = 0; g < group; g++) {
      const Lanes eight = eight_scores(q + g * dim, keys + t * key_stride, key_stride, dim, factor);
      store_lanes(scores + g * length + t, eight);
      for (int j = 0; j < 8; j++) tops[g] = std::max(tops[g], eight[j]);
    }
  for (int64_t t = by_eight; t < length; t++) {
    const float *key = keys + t * key_stride;
    for (int64_t g = 0; g < group; g++) {
      const float *query = q + g * dim;
      Lanes sum = {};
      for (int64_t d = 0; d < whole; d += 8) sum += load_lanes(query + d) * load_lanes(key + d);
      float dot = lane_sum(sum);
      for (int64_t d = whole; d < dim; d++) dot += query[d] * key[d];
      scores[g * length + t] = dot * factor;
      tops[g] = std::max(tops[g], dot * factor);
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float *row = scores + g * length;
    const Lanes top = Lanes{} + tops[g];
    Lanes sum = {};
    for (int64_t t = 0; t < blocks; t += 8) {
      const Lanes weights = exp_lanes(load_lanes(row + t) - top);
      store_lanes(row + t, weights);
      sum += weights;
    }
    float total = lane_sum(sum);
    for (int64_t t = blocks; t < length; t++) total += (row[t] = std::exp(row[t] - tops[g]));
    scales[g] = 1.f / total;
  }
  // the value rows a tile at a time, each tile read from memory once and from the L1/L2 cache
  // by the group's other query heads
  std::fill(out, out + group * dim, 0.f);
  for (int64_t start = 0; start < length; start += VALUE_TILE) {
    const int64_t rows = std::min(VALUE_TILE, length - start);
    const float *tile = values + start * value_stride;
    for (int64_t g = 0; g < group; g++) {
      const float *weights = scores + g * length + start, scale = scales[g];
      float *into = out + g * dim;
      int64_t column = 0;
      for (; column + 64 <= whole; column += 64)
        weigh_columns<8>(weights, scale, tile, value_stride, rows, column, into);
      for (; column + 32 <= whole; column += 32)
        weigh_columns<4>(weights, scale, tile, value_stride, rows, column, into);
      for (; column < whole; column += 8)
        weigh_columns<1>(weights, scale, tile, value_stride, rows, column, into);
      for (; column < dim; column++)
        for (int64_t t = 0; t < rows; t++)
          into[column] += weights[t] * scale * tile[t * value_stride + column];
    }
  }
}

// one query token per row (a decode step), fp32: for each (row, KV head), softmax(q . K) . V of
// the query heads sharing it, over the slot's prefix 0..position, read in place from the cache;
// rows in any slot order, no mask, no gather, each row's work its own length. Accumulates in
// fp32 as ATen's attention does.
at::Tensor decode_attention(const at::Tensor &query_in, const at::Tensor &key_cache,
                            const at::Tensor &value_cache, const int64_t *rows,
                            const int64_t *starts, double scale) {
  const at::Tensor query = query_in.contiguous();
  const int64_t count = query.size(0), heads = query.size(1), dim = query.size(3);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  at::Tensor out = at::empty(query.sizes(), query.options());
  const float *q = query.data_ptr<float>(), *k = key_cache.data_ptr<float>(),
              *v = value_cache.data_ptr<float>();
  float *o = out.data_ptr<float>();
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1),
                vs2 = value_cache.stride(2);
  const float factor = static_cast<float>(scale);
  // (row, KV head) items per thread: a step whose attention is a few microseconds of work runs
  // on the calling thread, without a parallel region to wait for
  int64_t longest = 1;
  for (int64_t r = 0; r < count; r++) longest = std::max(longest, starts[r] + 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (longest * dim * group));
  at::parallel_for(0, count * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * longest);
    for (int64_t item = begin; item < end; item++) {
      const int64_t r = item / kv_heads, kvh = item % kv_heads;
      const int64_t first = (r * heads + kvh * group) * dim;  // the group's query heads
      attend_group(q + first, group, k + rows[r] * ks0 + kvh * ks1, ks2,
                   v + rows[r] * vs0 + kvh * vs1, vs2, starts[r] + 1, dim, factor,
                   scores.data(), o + first);
    }
  });
  return out;
}

// a run of packed prefill rows at least this long (a long prompt's chunk) attends as one chunk
// over the slot's prefix, bottom-right causal (block attention on AVX-512, else ATen's with a
// mask), which beats the decode kernel a row at a time there (benchmarks/README.md,
// generate_streams.py's section); shorter runs (a burst of short prompts' tail ends) stay in
// the decode kernel
constexpr int64_t CHUNK_RUN = 16;

// queries [1, heads, tokens, head] of one slot from position ``start``: causal attention over
// the slot's prefix read in place (bottom-right causal past position 0), through ATen's kernel
at::Tensor slot_attention(const at::Tensor &queries, const at::Tensor &key_cache,
                          const at::Tensor &value_cache, int64_t slot, int64_t start,
                          std::optional<double> scale, bool gqa) {
  const int64_t tokens = queries.size(2), length = start + tokens;
  at::Tensor keys = key_cache.slice(0, slot, slot + 1).slice(2, 0, length);
  at::Tensor values = value_cache.slice(0, slot, slot + 1).slice(2, 0, length);
  if (tokens > 1) {  // block attention where it takes the chunk (AVX-512)
    at::Tensor blocked = cuvil_native::prefix_attention(queries, keys, values, start, scale, gqa);
    if (blocked.defined()) return blocked;
  }
  std::optional<at::Tensor> mask;
  if (tokens > 1 && start > 0) {
    at::Tensor seen = at::arange(length, key_cache.options().dtype(at::kLong));
    at::Tensor last = start + at::arange(tokens, seen.options());
    mask = seen.unsqueeze(0) <= last.unsqueeze(1);
  }
  return at::scaled_dot_product_attention(queries, keys, values, mask, 0.0,
                                          tokens > 1 && start == 0, scale, gqa);
}

// one token per row where runs of rows share a slot at consecutive positions (a packed
// prefill): runs of CHUNK_RUN rows or more as chunks, the other rows through the decode kernel
at::Tensor packed_attention(const at::Tensor &query, const at::Tensor &key_cache,
                            const at::Tensor &value_cache, const int64_t *rows,
                            const int64_t *starts, int64_t count, std::optional<double> scale,
                            bool gqa) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  std::vector<int64_t> single;  // rows outside long runs
  for (int64_t begin = 0; begin < count;) {
    int64_t end = begin + 1;
    while (end < count && rows[end] == rows[begin] && starts[end] == starts[end - 1] + 1) end++;
    if (end - begin >= CHUNK_RUN)
      out.slice(0, begin, end)  // the run's rows as one chunk: [1, heads, tokens, head]
          .copy_(slot_attention(query.slice(0, begin, end).transpose(0, 2), key_cache,
                                value_cache, rows[begin], starts[begin], scale, gqa)
                     .transpose(0, 2));
    else
      for (int64_t r = begin; r < end; r++) single.push_back(r);
    begin = end;
  }
  if (single.empty()) return out;
  at::Tensor picked = at::tensor(single, at::kLong);
  std::vector<int64_t> picked_rows, picked_starts;
  for (int64_t r : single) {
    picked_rows.push_back(rows[r]);
    picked_starts.push_back(starts[r]);
  }
  const double factor = scale.has_value() ? *scale : 1.0 / std::sqrt(double(query.size(3)));
  out.index_copy_(0, picked,
                  decode_attention(query.index_select(0, picked), key_cache, value_cache,
                                   picked_rows.data(), picked_starts.data(), factor));
  return out;
}

// kv_cache.py's attend(): causal attention of each row's queries over its slot's cache prefix
at::Tensor cached_attention(const at::Tensor &query, const at::Tensor &key_cache,
                            const at::Tensor &value_cache, const at::Tensor &slots,
                            const at::Tensor &positions, std::optional<double> scale) {
  const int64_t tokens = query.size(2);
  const bool gqa = query.size(1) != key_cache.size(1);
  at::Tensor rows_t = slots.to(at::kLong).contiguous(), starts_t = positions.to(at::kLong).contiguous();
  const int64_t *rows = rows_t.data_ptr<int64_t>(), *starts = starts_t.data_ptr<int64_t>();
  const int64_t count = rows_t.numel();
  TORCH_CHECK(count > 0, "cached attention over no rows");
  const int64_t longest = *std::max_element(starts, starts + count) + tokens;
  TORCH_CHECK_INDEX(longest <= key_cache.size(2), "a row reaches position ", longest,
                    " of a cache of ", key_cache.size(2));
  const bool plain = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                     value_cache.scalar_type() == at::kFloat && key_cache.stride(3) == 1 &&
                     value_cache.stride(3) == 1 && query.size(1) % key_cache.size(1) == 0;
  bool packed = false;  // rows sharing a slot at consecutive positions: a packed prefill
  for (int64_t r = 1; r < count && !packed; r++)
    packed = rows[r] == rows[r - 1] && starts[r] == starts[r - 1] + 1;
  if (tokens == 1 && plain && packed)
    return packed_attention(query, key_cache, value_cache, rows, starts, count, scale, gqa);
  if (tokens == 1 && plain)
    return decode_attention(query, key_cache, value_cache, rows, starts,
                            scale.has_value() ? *scale : 1.0 / std::sqrt(double(query.size(3))));
  bool consecutive = count > 1;
  for (int64_t r = 1; r < count && consecutive; r++) consecutive = rows[r] == rows[0] + r;
  if (tokens == 1 && consecutive) {
    at::Tensor keys = key_cache.slice(0, rows[0], rows[0] + count).slice(2, 0, longest);
    at::Tensor values = value_cache.slice(0, rows[0], rows[0] + count).slice(2, 0, longest);
    at::Tensor seen = at::arange(longest, positions.options()).unsqueeze(0) <= positions.unsqueeze(1);
    return at::scaled_dot_product_attention(query, keys, values, seen.view({count, 1, 1, longest}),
                                            0.0, false, scale, gqa);
  }
  std::vector<at::Tensor> out;
  for (int64_t r = 0; r < count; r++)
    out.push_back(slot_attention(query.slice(0, r, r + 1), key_cache, value_cache, rows[r],
                                 starts[r], scale, gqa));
  return out.size() == 1 ? out[0] : at::cat(out);
}

// the calling thread's intra-op thread count for a scope, restored however the scope ends
struct ThreadCount {
  int before;
  explicit ThreadCount(int threads) : before(at::get_num_threads()) { at::set_num_threads(threads); }
  ~ThreadCount() { at::set_num_threads(before); }
};

// linear_kernels.py's one-thread bf16 linear: the input cast to bf16, oneDNN's inner product
// (mkldnn::_linear_pointwise) on the calling thread alone, the result cast back to fp32. A
// one-row GEMM of a small weight costs less than the parallel region two threads would wait on.
at::Tensor bf16_linear_one_thread(const at::Tensor &x, const at::Tensor &packed,
                                  const std::optional<at::Tensor> &bias, c10::string_view attr,
                                  c10::List<std::optional<c10::Scalar>> scalars,
                                  std::optional<c10::string_view> algorithm) {
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x.to(at::kBFloat16));
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string(attr));
  stack.emplace_back(scalars);
  if (algorithm.has_value())
    stack.emplace_back(std::string(*algorithm));
  else
    stack.emplace_back(c10::IValue());
  {
    ThreadCount one(1);
    linear.callBoxed(&stack);
  }
  return stack.back().toTensor().to(at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def(
      "bf16_linear_one_thread(Tensor x, Tensor packed, Tensor? bias, str attr, Scalar?[] scalars, "
      "str? algorithm) -> Tensor",
      bf16_linear_one_thread);
  m.def("rms_norm(int kernel, Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
  m.def("rope(int kernel, Tensor x, Tensor cos, Tensor sin) -> Tensor", rope);
  m.def("max_pool2d(int kernel, Tensor x, int[] window) -> Tensor", max_pool2d);
  m.def("silu_mul(Tensor projected, int hidden) -> Tensor", silu_mul);
  m.def(
      "winograd(int input_kernel, int output_kernel, Tensor x, Tensor transformed, Tensor? bias, "
      "Tensor? residual, int[] geometry, bool donated) -> Tensor",
      winograd);
  m.def(
      "kv_cache_write(Tensor(a!) cache, Tensor new, Tensor slots, Tensor positions) -> Tensor(a!)",
      kv_cache_write);
  m.def(
      "cached_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
      "Tensor positions, float? scale) -> Tensor",
      cached_attention);
}
