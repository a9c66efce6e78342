// Vector math shared by the native kernels, on GCC vector types of any width (eight lanes in the
// decode kernel, sixteen in block attention), so each compiles to the registers of the target
// its function is cloned for.
#pragma once

#include <cstring>

// a vector of F's lanes from floats anywhere in memory, and back (no alignment asked)
template <typename F>
__attribute__((always_inline)) inline F load_vector(const float *from) {
  F lanes;
  std::memcpy(&lanes, from, sizeof lanes);
  return lanes;
}

template <typename F>
__attribute__((always_inline)) inline void store_vector(float *to, F lanes) {
  std::memcpy(to, &lanes, sizeof lanes);
}

// exp of lanes at or below zero (scores less their maximum): Cephes' expf, 2^n times a
// degree-6 polynomial on [-ln2/2, ln2/2], within 2 ulp of std::exp; below -87.3 it gives
// 2^-126 times a fraction, where std::exp underflows to about the same nothing. F: float lanes,
// I: int32 lanes of the same count.
template <typename F, typename I>
__attribute__((always_inline)) inline F exp_at_most_zero(F x) {
  const F lowest = F{} - 87.3f;
  x = x < lowest ? lowest : x;
  const F scaled = x * 1.44269504088896341f + 0.5f;
  F whole = __builtin_convertvector(__builtin_convertvector(scaled, I), F);
  whole = whole > scaled ? whole - 1.0f : whole;  // floor: conversion truncates toward zero
  x = x - whole * 0.693359375f + whole * 2.12194440e-4f;
  F poly = 1.9875691500e-4f * x + 1.3981999507e-3f;
  poly = poly * x + 8.3334519073e-3f;
  poly = poly * x + 4.1665795894e-2f;
  poly = poly * x + 1.6666665459e-1f;
  poly = poly * x + 5.0000001201e-1f;
  const F fraction = poly * (x * x) + x + 1.0f;
  const I exponent = (__builtin_convertvector(whole, I) + 127) << 23;
  F power;
  std::memcpy(&power, &exponent, sizeof power);
  return fraction * power;
}
