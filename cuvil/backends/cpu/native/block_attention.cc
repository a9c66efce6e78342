// Attention over whole short sequences (an encoder's, a prompt's), fp32, as a dispatcher op:
// softmax(scale * Q K^T + mask) V with an optional causal limit and grouped KV heads, the
// semantics of ATen's scaled_dot_product_attention, for the shapes it takes (head dims a
// multiple of 16 up to 256, up to MAX_KEYS keys); other calls go to ATen's.
//
// Each task is one (batch, head) pair's block of up to BLOCK_ROWS query rows. A thread
// transposes a KV head's keys once into a dim-major buffer for its tasks on that head, so a
// register tile of R query rows by 2 N keys sums over the head dim with two vector loads and
// R broadcasts per 2 R multiply-adds, scaling, masking and taking each row's maximum as it
// stores; each row's scores then become softmax weights in place (the whole row at once: at
// these lengths it fits in L2, so no running maximum is needed), and the weighted sum of value
// rows is a second register tile of R rows by 2 N columns. The code is built twice: N = 16
// lanes and R = 8 rows for AVX-512 (x86-64-v4: the tiles take 16 of its 32 vector registers),
// N = 8 and R = 4 for AVX2 (x86-64-v3: 8 of its 16), and run where the CPU has one of them; on
// other CPUs every call goes to ATen's kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

// the vector types of an N-lane build
template <int64_t N>
struct Lanes {
  typedef float Floats __attribute__((vector_size(4 * N)));
  typedef int32_t Ints __attribute__((vector_size(4 * N)));
};

// which build this CPU runs: 4 (AVX-512), 3 (AVX2 with FMA), 0 (none: ATen's kernel)
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

constexpr int64_t BLOCK_ROWS = 32;  // query rows of a task
constexpr int64_t MAX_KEYS = 2048;  // longer sequences go to ATen's blocked (flash) kernel
constexpr int64_t MAX_DIM = 256;
constexpr int64_t DIM_STEP = 16;  // head dims are a multiple of this (an output tile's width)
constexpr int64_t KEY_STEP = 32;  // score rows are padded to a multiple of this (both builds)

template <int64_t N>
__attribute__((always_inline)) inline typename Lanes<N>::Floats load(const float *from) {
  return load_vector<typename Lanes<N>::Floats>(from);
}

template <int64_t N>
__attribute__((always_inline)) inline void store(float *to, typename Lanes<N>::Floats lanes) {
  store_vector(to, lanes);
}

// one task's operands: row pointers and strides in floats
struct Block {
  const float *q;  // the block's first query row
  int64_t q_row;
  const float *k, *v;  // the KV head's first key and value rows
  int64_t k_row, v_row;
  const float *mask;  // the block's first mask row, or null
  int64_t mask_row;   // 0 where the mask broadcasts over query rows
  float *out;         // the block's first output row
  int64_t out_row;
  int64_t rows, first_row;  // the block's query rows, and the index of its first
  int64_t offset;           // causal: query row i sees keys up to offset + i
  int64_t keys, dim;
  float scale;
  bool causal;
};

// keys [keys, dim] into dim-major [dim, padded], zero past the last key; read down the columns
// (the head's keys sit in L1) so that the writes run along the rows
void transpose_keys(const Block &b, int64_t padded, float *kt) {
  for (int64_t d = 0; d < b.dim; d++) {
    float *row = kt + d * padded;
    const float *column = b.k + d;
    for (int64_t t = 0; t < b.keys; t++) row[t] = column[t * b.k_row];
    std::fill(row + b.keys, row + padded, 0.f);
  }
}

// how many leading keys query row ``row`` of the block sees
inline int64_t seen(const Block &b, int64_t row) {
  return b.causal ? std::min(b.keys, b.offset + b.first_row + row + 1) : b.keys;
}

// the largest of a vector's lanes
template <int64_t N>
__attribute__((always_inline)) inline float lane_max(typename Lanes<N>::Floats lanes) {
  float top = lanes[0];
  for (int64_t l = 1; l < N; l++) top = std::max(top, lanes[l]);
  return top;
}

// the scores of R query rows by 2 N keys from ``t`` (a short tile repeats its last row), the
// scale and mask applied as they are stored, and each row's running maximum; lanes past what
// a row sees are -inf
template <int64_t N, int64_t R>
__attribute__((always_inline)) inline void score_tile(const Block &b, const float *const *q,
                                                      const float *const *mask, int64_t r0,
                                                      int64_t count, int64_t t, const float *kt,
                                                      int64_t padded, float *scores,
                                                      typename Lanes<N>::Floats *tops) {
  typedef typename Lanes<N>::Floats V;
  V sums[R][2] = {};
  for (int64_t d = 0; d < b.dim; d++) {
    const V k0 = load<N>(kt + d * padded + t), k1 = load<N>(kt + d * padded + t + N);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; r++) {
      sums[r][0] += q[r][d] * k0;
      sums[r][1] += q[r][d] * k1;
    }
  }
  for (int64_t r = 0; r < count; r++) {
    float *into = scores + (r0 + r) * padded + t;
    V s0 = sums[r][0] * b.scale, s1 = sums[r][1] * b.scale;
    const int64_t sees = seen(b, r0 + r);
    if (t + 2 * N <= sees) {
      if (mask[r]) {
        s0 += load<N>(mask[r] + t);
        s1 += load<N>(mask[r] + t + N);
      }
      store<N>(into, s0);
      store<N>(into + N, s1);
    } else {  // the row's last keys (or past them), lane by lane
      store<N>(into, s0);
      store<N>(into + N, s1);
      for (int64_t l = 0; l < 2 * N; l++)
        into[l] = t + l < sees ? into[l] + (mask[r] ? mask[r][t + l] : 0.f)
                               : -std::numeric_limits<float>::infinity();
      s0 = load<N>(into);
      s1 = load<N>(into + N);
    }
    tops[r] = s0 > tops[r] ? s0 : tops[r];
    tops[r] = s1 > tops[r] ? s1 : tops[r];
  }
}

// one row's scores into softmax weights in place, zero from what it sees to ``padded``;
// returns 1 / their sum (0 for a row that sees nothing, whose weights are all zero, as ATen's)
template <int64_t N>
__attribute__((always_inline)) inline float softmax_row(float *row, int64_t sees, float top,
                                                        int64_t padded) {
  typedef typename Lanes<N>::Floats V;
  const float lowest = -std::numeric_limits<float>::infinity();
  if (top == lowest) {
    std::fill(row, row + padded, 0.f);
    return 0.f;
  }
  const int64_t whole = sees - sees % N;
  const V tops = V{} + top;
  V sums = {};
  for (int64_t t = 0; t < whole; t += N) {
    const V weights = exp_at_most_zero<V, typename Lanes<N>::Ints>(load<N>(row + t) - tops);
    store<N>(row + t, weights);
    sums += weights;
  }
  float total = 0.f;
  for (int64_t l = 0; l < N; l++) total += sums[l];
  for (int64_t t = whole; t < sees; t++) total += (row[t] = std::exp(row[t] - top));
  std::fill(row + sees, row + padded, 0.f);
  return 1.f / total;
}

// ``kt``: the block's keys as transpose_keys leaves them, ``padded`` floats a dim; ``scores``:
// BLOCK_ROWS rows of ``padded`` floats
template <int64_t N, int64_t R>
__attribute__((always_inline)) inline void attend_block(const Block &b, const float *kt,
                                                        int64_t padded, float *scores) {
  typedef typename Lanes<N>::Floats V;
  float inverse[BLOCK_ROWS];
  for (int64_t r0 = 0; r0 < b.rows; r0 += R) {
    const int64_t count = std::min(R, b.rows - r0);
    const int64_t limit = seen(b, r0 + count - 1);  // causal: later keys are never read
    const float *q[R], *mask[R];
    for (int64_t r = 0; r < R; r++) {
      q[r] = b.q + (r0 + std::min(r, count - 1)) * b.q_row;
      mask[r] = b.mask ? b.mask + (r0 + r) * b.mask_row : nullptr;
    }
    V tops[R];
    for (int64_t r = 0; r < R; r++) tops[r] = V{} - std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < limit; t += 2 * N)
      score_tile<N, R>(b, q, mask, r0, count, t, kt, padded, scores, tops);
    for (int64_t r = 0; r < count; r++)
      inverse[r0 + r] = softmax_row<N>(scores + (r0 + r) * padded, seen(b, r0 + r),
                                       lane_max<N>(tops[r]), padded);
  }
  // outputs: R rows by 2 N (or N) columns per register tile over the value rows
  for (int64_t r0 = 0; r0 < b.rows; r0 += R) {
    const int64_t count = std::min(R, b.rows - r0);
    const int64_t limit = seen(b, r0 + count - 1);
    const float *weights[R];
    for (int64_t r = 0; r < R; r++) weights[r] = scores + (r0 + std::min(r, count - 1)) * padded;
    for (int64_t column = 0; column < b.dim; column += 2 * N) {
      const bool pair = column + 2 * N <= b.dim;
      V sums[R][2] = {};
      for (int64_t t = 0; t < limit; t++) {
        const float *value = b.v + t * b.v_row + column;
        const V v0 = load<N>(value), v1 = pair ? load<N>(value + N) : V{};
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; r++) {
          sums[r][0] += weights[r][t] * v0;
          sums[r][1] += weights[r][t] * v1;
        }
      }
      for (int64_t r = 0; r < count; r++) {
        float *into = b.out + (r0 + r) * b.out_row + column;
        store<N>(into, sums[r][0] * inverse[r0 + r]);
        if (pair) store<N>(into + N, sums[r][1] * inverse[r0 + r]);
      }
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) void attend_block_wide(const Block &b,
                                                                 const float *kt,
                                                                 int64_t padded, float *scores) {
  attend_block<16, 8>(b, kt, padded, scores);
}

__attribute__((target("arch=x86-64-v3"))) void attend_block_narrow(const Block &b,
                                                                   const float *kt,
                                                                   int64_t padded,
                                                                   float *scores) {
  attend_block<8, 4>(b, kt, padded, scores);
}
#else
void attend_block_wide(const Block &, const float *, int64_t, float *) {}
void attend_block_narrow(const Block &, const float *, int64_t, float *) {}
#endif

// the mask as fp32 [batch or 1, heads or 1, queries or 1, keys] with a unit key stride, or an
// undefined tensor where there is none; false where it does not broadcast so
bool additive_mask(const std::optional<at::Tensor> &given, at::IntArrayRef shape,
                   at::Tensor &mask) {
  if (!given.has_value() || !given->defined()) return true;
  at::Tensor m = *given;
  if (m.dim() > 4 || m.size(-1) != shape[3]) return false;
  while (m.dim() < 4) m = m.unsqueeze(0);
  for (int64_t d = 0; d < 3; d++)
    if (m.size(d) != 1 && m.size(d) != shape[d]) return false;
  if (m.scalar_type() == at::kBool) {
    m = at::where(m, at::zeros({}, m.options().dtype(at::kFloat)),
                  at::full({}, -std::numeric_limits<float>::infinity(),
                           m.options().dtype(at::kFloat)));
  } else if (m.scalar_type() != at::kFloat) {
    return false;
  }
  mask = m.stride(3) == 1 ? m : m.contiguous();
  return true;
}

bool takes(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
  for (const at::Tensor *t : {&q, &k, &v})
    if (t->scalar_type() != at::kFloat || !t->device().is_cpu() || t->dim() != 4) return false;
  const int64_t dim = q.size(3);
  return dim % DIM_STEP == 0 && dim <= MAX_DIM && k.size(3) == dim && v.size(3) == dim &&
         k.size(0) == q.size(0) && v.size(0) == q.size(0) && v.size(1) == k.size(1) &&
         v.size(2) == k.size(2) && k.size(2) >= 1 && k.size(2) <= MAX_KEYS &&
         k.size(1) >= 1 && q.size(1) % k.size(1) == 0;
}

// whether block_attention runs these operands itself (else it hands them to ATen's kernel);
// ``mask`` is set to the additive fp32 mask it would use
bool runs_natively(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                   const std::optional<at::Tensor> &mask_in, bool causal, bool gqa,
                   at::Tensor &mask) {
  const bool grouped = key.size(1) != query.size(1);
  return level() >= 3 && takes(query, key, value) && (!grouped || gqa) &&
         !(causal && mask_in.has_value() && mask_in->defined()) &&
         additive_mask(mask_in, {query.size(0), query.size(1), query.size(2), key.size(2)}, mask);
}

bool block_attention_takes(const at::Tensor &query, const at::Tensor &key,
                           const at::Tensor &value, const std::optional<at::Tensor> &mask,
                           bool causal, bool gqa) {
  at::Tensor unused;
  return runs_natively(query, key, value, mask, causal, gqa, unused);
}

// the attention of operands runs_natively took (``mask`` as it left it); causal rows see keys up
// to ``offset`` past their own index
at::Tensor attend(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                  const at::Tensor &mask, bool causal, int64_t offset,
                  std::optional<double> scale) {
  const int64_t heads = query.size(1);
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  const int64_t batch = q.size(0), queries = q.size(2), keys = k.size(2), dim = q.size(3);
  const int64_t group = heads / k.size(1);
  const float factor = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(dim));
  // [batch, queries, heads, dim] underneath, handed back as [batch, heads, queries, dim], as
  // ATen's CPU kernel does: the heads' usual merge after it is then a view
  at::Tensor out = at::empty({batch, queries, heads, dim}, q.options());
  const int64_t blocks = (queries + BLOCK_ROWS - 1) / BLOCK_ROWS;
  const int64_t padded = (keys + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
  const auto block_kernel = level() == 4 ? attend_block_wide : attend_block_narrow;
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(dim * padded), scores(BLOCK_ROWS * padded);
    int64_t held = -1;  // the (batch, KV head) whose keys kt holds: a thread's tasks run in order
    for (int64_t task = begin; task < end; task++) {
      const int64_t n = task / (heads * blocks), h = task / blocks % heads;
      const int64_t first = task % blocks * BLOCK_ROWS, kvh = h / group;
      Block b{};
      b.q = q.data_ptr<float>() + n * q.stride(0) + h * q.stride(1) + first * q.stride(2);
      b.q_row = q.stride(2);
      b.k = k.data_ptr<float>() + n * k.stride(0) + kvh * k.stride(1);
      b.k_row = k.stride(2);
      b.v = v.data_ptr<float>() + n * v.stride(0) + kvh * v.stride(1);
      b.v_row = v.stride(2);
      if (mask.defined()) {
        const int64_t mn = mask.size(0) == 1 ? 0 : n, mh = mask.size(1) == 1 ? 0 : h;
        b.mask_row = mask.size(2) == 1 ? 0 : mask.stride(2);
        b.mask = mask.data_ptr<float>() + mn * mask.stride(0) + mh * mask.stride(1) +
                 first * b.mask_row;
      }
      b.out = out.data_ptr<float>() + ((n * queries + first) * heads + h) * dim;
      b.out_row = heads * dim;
      b.rows = std::min(BLOCK_ROWS, queries - first);
      b.first_row = first;
      b.offset = offset;
      b.keys = keys;
      b.dim = dim;
      b.scale = factor;
      b.causal = causal;
      if (n * k.size(1) + kvh != held) {
        transpose_keys(b, padded, kt.data());
        held = n * k.size(1) + kvh;
      }
      block_kernel(b, kt.data(), padded, scores.data());
    }
  });
  return out.transpose(1, 2);
}

at::Tensor block_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                           const std::optional<at::Tensor> &mask_in, bool causal,
                           std::optional<double> scale, bool gqa) {
  at::Tensor mask;
  if (!runs_natively(query, key, value, mask_in, causal, gqa, mask))
    return at::scaled_dot_product_attention(query, key, value, mask_in, 0.0, causal, scale, gqa);
  return attend(query, key, value, mask, causal, 0, scale);
}

}  // namespace

namespace cuvil_native {

at::Tensor prefix_attention(const at::Tensor &queries, const at::Tensor &keys,
                            const at::Tensor &values, int64_t start, std::optional<double> scale,
                            bool gqa) {
  at::Tensor unused;
  if (start < 0 || keys.size(2) != start + queries.size(2) ||
      !runs_natively(queries, keys, values, std::nullopt, true, gqa, unused))
    return at::Tensor();
  return attend(queries, keys, values, at::Tensor(), true, start, scale);
}

}  // namespace cuvil_native

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def(
      "block_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, bool causal, "
      "float? scale, bool gqa) -> Tensor",
      block_attention);
  m.def(
      "block_attention_takes(Tensor query, Tensor key, Tensor value, Tensor? mask, bool causal, "
      "bool gqa) -> bool",
      block_attention_takes);
}
