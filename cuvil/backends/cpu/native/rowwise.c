/* Row-wise kernels of decoder models on fp32 tensors whose last dim is contiguous:
 *
 *   RMSNorm  out[r] = x[r] * 1 / sqrt(mean(x[r]^2) + eps) * weight
 *   RoPE     out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x2, x1)
 *
 * As torch ops each is four or five passes over memory with a temporary per pass (about 35-40
 * us for a 128 x 256 activation on a 2-core EPYC, several times the memory traffic it needs);
 * here each is one pass. Rows are shared out by OpenMP (the libgomp torch loaded) when there are
 * enough of them to pay for waking the team.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMENTS 8192 /* below this one thread beats waking the others (32K: 7.5 vs 11.9 us) */

/* x: rows of `width` floats, `x_stride` floats apart; out: contiguous rows */
void cuvil_rms_norm(const float *x, int64_t rows, int64_t width, int64_t x_stride,
                    const float *weight, float eps, float *out, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float *o = out + r * width;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++)
            squares += row[i] * row[i];
        const float scale = 1.0f / sqrtf(squares / (float)width + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            o[i] = row[i] * scale * weight[i];
    }
}

/* x, cos, sin: [n0, n1, n2, width], each given by its strides for the first three dims (0 where
 * broadcast; the last dim is contiguous); out: contiguous. width is even. */
void cuvil_rope(const float *x, int64_t xs0, int64_t xs1, int64_t xs2, const float *cos,
                int64_t cs0, int64_t cs1, int64_t cs2, const float *sin, int64_t ss0, int64_t ss1,
                int64_t ss2, int64_t n0, int64_t n1, int64_t n2, int64_t width, float *out,
                int threads)
{
    const int64_t half = width / 2, rows = n0 * n1 * n2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i2 = r % n2, i1 = (r / n2) % n1, i0 = r / (n2 * n1);
        const float *a = x + i0 * xs0 + i1 * xs1 + i2 * xs2;
        const float *c = cos + i0 * cs0 + i1 * cs1 + i2 * cs2;
        const float *s = sin + i0 * ss0 + i1 * ss1 + i2 * ss2;
        float *o = out + r * width;
#pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            o[j] = a[j] * c[j] - a[j + half] * s[j];
            o[j + half] = a[j + half] * c[j + half] + a[j] * s[j + half];
        }
    }
}
