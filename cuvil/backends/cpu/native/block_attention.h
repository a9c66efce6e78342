// What kernel_ops.cc takes from block_attention.cc.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace cuvil_native {

// causal attention of ``queries`` [batch, heads, tokens, dim] at positions start.. over
// ``keys`` and ``values`` at positions 0..start + tokens - 1 (a prompt chunk over its slot's
// prefix: query i sees keys up to start + i), by block attention; an undefined tensor where
// that kernel does not take the call (the caller then runs ATen's)
at::Tensor prefix_attention(const at::Tensor &queries, const at::Tensor &keys,
                            const at::Tensor &values, int64_t start, std::optional<double> scale,
                            bool gqa);

}  // namespace cuvil_native
