// Causal attention over a decoder's KV cache (cuvil/backends/kv_cache.py's attend(), here
// without Python between) as the dispatcher op ``cuvil_native::cached_attention``: a decode
// step's rows through this file's kernel, reading the cache in place; a packed prefill's long
// runs of one slot as chunks (block attention where it takes them, block_attention.cc, else
// ATen's); what neither takes through ATen's ``scaled_dot_product_attention``. The cache holds
// fp32 or bf16 values (a bf16 model's: the dtype its own attention reads), the arithmetic is
// fp32 either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "block_attention.h"
#include "eight_lanes.h"

namespace {

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

// ``rows`` rows of ``dim`` values, ``stride`` apart, as fp32: fp32 rows where they lie; bf16
// rows widened into ``scratch`` once (``dim`` apart), so that every query head of the group
// reads them from L1 rather than widening them again (measured: widening in the dot products
// made a bf16 cache slower than an fp32 one once the cache was in L2/L3). ``stride`` becomes the
// returned rows' stride.
__attribute__((always_inline)) inline const float *widened(const float *at, int64_t, int64_t &,
                                                          int64_t, float *) {
  return at;
}

__attribute__((always_inline)) inline const float *widened(const uint16_t *at, int64_t rows,
                                                          int64_t &stride, int64_t dim,
                                                          float *scratch) {
  const int64_t whole = dim - dim % 8;
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *from = at + r * stride;
    float *to = scratch + r * dim;
    int64_t d = 0;
    for (; d < whole; d += 8) store_lanes(to + d, load_lanes(from + d));
    for (; d < dim; d++) to[d] = to_float(from[d]);
  }
  stride = dim;
  return scratch;
}

// the attention of ``group`` query heads that share one KV head (GQA; 1 without it) over
// ``length`` cached positions: scores (scaled q . k), softmax, the weighted sum of values into
// ``out`` (``group`` rows of ``dim``), eight lanes at a time. The scores are computed key row
// by key row for the whole group, so each key is read from memory once however many query
// heads share it (at long lengths a head's keys outgrow the L2 cache); each query head's
// output columns then sum in registers over the value rows. Built twice (AVX2 with FMA, and
// the baseline), the loader picking the one this CPU runs, so one build serves every x86 CPU.
// ``scores`` holds ``group * length`` floats. Keys and values are fp32 or bf16 (a bf16 model's
// cache: half the bytes a step reads), the arithmetic fp32 either way; ``scratch`` holds
// ``VALUE_TILE * dim`` floats for widened bf16 rows.
template <typename T>
__attribute__((always_inline)) inline void attend_group_of(
    const float *q, int64_t group, const T *keys, int64_t key_stride, const T *values,
    int64_t value_stride, int64_t length, int64_t dim, float factor, float *scores, float *scratch,
    float *out) {
  const int64_t whole = dim - dim % 8, blocks = length - length % 8;
  const int64_t by_eight = dim % 8 == 0 ? blocks : 0;  // keys scored eight at a time
  std::vector<float> tops(group, -INFINITY), scales(group);  // each head's max, 1 / its sum
  for (int64_t t = 0; t < by_eight; t += 8) {
    int64_t stride = key_stride;
    const float *eight_keys = widened(keys + t * key_stride, 8, stride, dim, scratch);
    for (int64_t g = 0; g < group; g++) {
      const Lanes eight = eight_scores(q + g * dim, eight_keys, stride, dim, factor);
      store_lanes(scores + g * length + t, eight);
      for (int j = 0; j < 8; j++) tops[g] = std::max(tops[g], eight[j]);
    }
  }
  for (int64_t t = by_eight; t < length; t++) {
    const T *key = keys + t * key_stride;
    for (int64_t g = 0; g < group; g++) {
      const float *query = q + g * dim;
      Lanes sum = {};
      for (int64_t d = 0; d < whole; d += 8) sum += load_lanes(query + d) * load_lanes(key + d);
      float dot = lane_sum(sum);
      for (int64_t d = whole; d < dim; d++) dot += query[d] * to_float(key[d]);
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
    int64_t stride = value_stride;
    const float *tile = widened(values + start * value_stride, rows, stride, dim, scratch);
    for (int64_t g = 0; g < group; g++) {
      const float *weights = scores + g * length + start, scale = scales[g];
      float *into = out + g * dim;
      int64_t column = 0;
      for (; column + 64 <= whole; column += 64)
        weigh_columns<8>(weights, scale, tile, stride, rows, column, into);
      for (; column + 32 <= whole; column += 32)
        weigh_columns<4>(weights, scale, tile, stride, rows, column, into);
      for (; column < whole; column += 8)
        weigh_columns<1>(weights, scale, tile, stride, rows, column, into);
      for (; column < dim; column++)
        for (int64_t t = 0; t < rows; t++)
          into[column] += weights[t] * scale * tile[t * stride + column];
    }
  }
}

// one clone set per cache element type, each a plain function around the inlined template, so
// that every clone compiles the whole body for its own ISA
CUVIL_CLONES void attend_group(const float *q, int64_t group, const float *keys,
                               int64_t key_stride, const float *values, int64_t value_stride,
                               int64_t length, int64_t dim, float factor, float *scores,
                               float *scratch, float *out) {
  attend_group_of(q, group, keys, key_stride, values, value_stride, length, dim, factor, scores,
                  scratch, out);
}

CUVIL_CLONES void attend_group(const float *q, int64_t group, const uint16_t *keys,
                               int64_t key_stride, const uint16_t *values, int64_t value_stride,
                               int64_t length, int64_t dim, float factor, float *scores,
                               float *scratch, float *out) {
  attend_group_of(q, group, keys, key_stride, values, value_stride, length, dim, factor, scores,
                  scratch, out);
}

// the cache's elements for the kernel: fp32, or bf16 as their bits
template <typename T>
const T *elements(const at::Tensor &cache) {
  return static_cast<const T *>(cache.data_ptr());
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
  const float *q = query.data_ptr<float>();
  const bool half = key_cache.scalar_type() == at::kBFloat16;
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
    std::vector<float> scores(group * longest), scratch(half ? VALUE_TILE * dim : 0);
    for (int64_t item = begin; item < end; item++) {
      const int64_t r = item / kv_heads, kvh = item % kv_heads;
      const int64_t first = (r * heads + kvh * group) * dim;  // the group's query heads
      const int64_t key_at = rows[r] * ks0 + kvh * ks1, value_at = rows[r] * vs0 + kvh * vs1;
      if (half)
        attend_group(q + first, group, elements<uint16_t>(key_cache) + key_at, ks2,
                     elements<uint16_t>(value_cache) + value_at, vs2, starts[r] + 1, dim, factor,
                     scores.data(), scratch.data(), o + first);
      else
        attend_group(q + first, group, elements<float>(key_cache) + key_at, ks2,
                     elements<float>(value_cache) + value_at, vs2, starts[r] + 1, dim, factor,
                     scores.data(), scratch.data(), o + first);
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
  at::Tensor keys = key_cache.slice(0, slot, slot + 1).slice(2, 0, length).to(queries.scalar_type());
  at::Tensor values =
      value_cache.slice(0, slot, slot + 1).slice(2, 0, length).to(queries.scalar_type());
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
  const at::ScalarType element = key_cache.scalar_type();
  const bool plain = query.scalar_type() == at::kFloat &&
                     (element == at::kFloat || element == at::kBFloat16) &&
                     value_cache.scalar_type() == element && key_cache.stride(3) == 1 &&
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
    const at::ScalarType wanted = query.scalar_type();
    at::Tensor keys = key_cache.slice(0, rows[0], rows[0] + count).slice(2, 0, longest).to(wanted);
    at::Tensor values =
        value_cache.slice(0, rows[0], rows[0] + count).slice(2, 0, longest).to(wanted);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def(
      "cached_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
      "Tensor positions, float? scale) -> Tensor",
      cached_attention);
}
