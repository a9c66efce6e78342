// MKL's sgemm on a weight packed once (backends/cpu/packed_gemm.py), as dispatcher ops so the
// native plan loop calls it like any ATen op. The packing stays MKL's opaque layout of the
// transposed weight; `compute` is the address of `cblas_sgemm_compute` in the libtorch_cpu
// this process loaded (found with ctypes), so the library does not link MKL itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <limits>

namespace {

// cblas_sgemm_compute (LP64): layout, transa, transb (or "packed"), m, n, k, a, lda, b, ldb,
// beta, c, ldc
using SgemmCompute = void (*)(int, int, int, int, int, int, const float *, int, const float *,
                              int, float, float *, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kPacked = 151;

bool fits_int(int64_t value) { return value <= std::numeric_limits<int>::max(); }

// rows x W^T into out (beta 0: overwritten; 1: accumulated into what out holds)
void packed_gemm(int64_t compute, const at::Tensor &x, const at::Tensor &packed,
                 at::Tensor &out, float beta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "packed GEMM: fp32 rows expected");
  TORCH_CHECK(packed.is_contiguous(), "packed GEMM: the packed weight must be contiguous");
  const bool strided_rows = x.stride(1) == 1 && (x.size(0) <= 1 || x.stride(0) >= x.size(1));
  at::Tensor rows = strided_rows ? x : x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), n = out.size(1);
  // one row's stride is whatever its view says (contiguous either way): MKL wants at least k
  const int64_t lda = m <= 1 ? k : rows.stride(0);
  TORCH_CHECK(out.size(0) == m && out.is_contiguous(), "packed GEMM: output shape");
  TORCH_CHECK(fits_int(m) && fits_int(n) && fits_int(k) && fits_int(lda),
              "packed GEMM: dimensions past 32 bits");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // nothing to multiply: MKL is not asked to read an empty operand
    if (beta == 0.0f) out.zero_();
    return;
  }
  reinterpret_cast<SgemmCompute>(compute)(
      kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
      rows.data_ptr<float>(), static_cast<int>(lda),
      static_cast<const float *>(packed.data_ptr()), static_cast<int>(k), beta,
      out.data_ptr<float>(), static_cast<int>(n));
}

// x W^T + bias over rows [m, k] -> [m, out_features]
at::Tensor packed_linear(int64_t compute, const at::Tensor &x, const at::Tensor &packed,
                         int64_t out_features, const std::optional<at::Tensor> &bias) {
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  if (bias.has_value() && bias->defined()) {
    // each row starts as a copy of the bias, and the GEMM accumulates into it
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out_features, "packed GEMM: bias size");
    const float *from = b.data_ptr<float>();
    float *rows = out.data_ptr<float>();
    at::parallel_for(0, out.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; r++)
        std::memcpy(rows + r * out_features, from, sizeof(float) * out_features);
    });
    packed_gemm(compute, x, packed, out, 1.0f);
  } else {
    packed_gemm(compute, x, packed, out, 0.0f);
  }
  return out;
}

// out += x W^T (out holds residual + bias, a fresh buffer)
at::Tensor &packed_linear_add_(int64_t compute, at::Tensor &out, const at::Tensor &x,
                               const at::Tensor &packed) {
  if (out.is_contiguous()) {
    packed_gemm(compute, x, packed, out, 1.0f);
  } else {
    at::Tensor dense = out.contiguous();
    packed_gemm(compute, x, packed, dense, 1.0f);
    out.copy_(dense);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cuvil_native, m) {
  m.def(
      "packed_linear(int compute, Tensor x, Tensor packed, int out_features, Tensor? bias) -> "
      "Tensor",
      packed_linear);
  m.def(
      "packed_linear_add_(int compute, Tensor(a!) out, Tensor x, Tensor packed) -> Tensor(a!)",
      packed_linear_add_);
}
