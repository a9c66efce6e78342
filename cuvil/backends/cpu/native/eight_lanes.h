// Eight fp32 lanes, the vector width of the kernels built as CUVIL_CLONES (kernel_ops.cc,
// cached_attention.cc): AVX registers in the x86-64-v3 clone, SSE pairs in the baseline one.
#pragma once

#include <cstdint>
#include <cstring>

#include "vector_math.h"

typedef float Lanes __attribute__((vector_size(32)));
typedef int32_t IntLanes __attribute__((vector_size(32)));
typedef uint16_t HalfLanes __attribute__((vector_size(16)));  // eight bf16 values' bits

#if defined(__x86_64__)
#define CUVIL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CUVIL_CLONES
#endif

__attribute__((always_inline)) inline Lanes load_lanes(const float *from) {
  return load_vector<Lanes>(from);
}

// eight bf16 values widened to fp32: a bf16 value is the top half of its fp32
__attribute__((always_inline)) inline Lanes load_lanes(const uint16_t *from) {
  HalfLanes halves;
  std::memcpy(&halves, from, sizeof halves);
  const IntLanes words = __builtin_convertvector(halves, IntLanes) << 16;
  Lanes lanes;
  std::memcpy(&lanes, &words, sizeof lanes);
  return lanes;
}

__attribute__((always_inline)) inline float to_float(float value) { return value; }

__attribute__((always_inline)) inline float to_float(uint16_t bits) {
  const uint32_t word = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

__attribute__((always_inline)) inline void store_lanes(float *to, Lanes lanes) {
  store_vector(to, lanes);
}

// exp of eight lanes at or below zero (vector_math.h)
__attribute__((always_inline)) inline Lanes exp_lanes(Lanes x) {
  return exp_at_most_zero<Lanes, IntLanes>(x);
}

// the sum of eight lanes, pairwise
__attribute__((always_inline)) inline float lane_sum(Lanes lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}
