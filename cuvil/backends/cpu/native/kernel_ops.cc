// Cuvil's own kernels as dispatcher ops, so the native plan loop (plan_loop.cc) calls them like
// any ATen op: the C kernels of rowwise.c, winograd.c and pooling.c (each built for this CPU and loaded by
// ctypes; the op is handed the function's address), SwiGLU's gating, and the KV-cache write of
// decoder generation (cuvil/backends/kv_cache.py's ATen calls, here without Python between;
// its attention is cached_attention.cc).
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

#include "eight_lanes.h"

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
// (fp32 rows into a bf16 cache rounded to it, as the cache's own copy_ would)
at::Tensor &kv_cache_write(at::Tensor &cache, const at::Tensor &written, const at::Tensor &slots,
                           const at::Tensor &positions) {
  const at::Tensor fresh = written.to(cache.scalar_type());
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
}
