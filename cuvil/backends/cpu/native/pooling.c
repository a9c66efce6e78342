/* Max pooling over channels-last fp32 tensors: out[n, oh, ow, c] = max of x[n, ih, iw, c] over
 * the window, padding never chosen (as torch's max_pool2d: padded positions are -inf).
 *
 * Channels are contiguous in both tensors, so each output pixel is the elementwise maximum of
 * the window's input pixels, one vector pass per pixel, the window's rows hot in cache; no
 * indices are computed (ATen's CPU max_pool2d computes and drops them, about four times this
 * kernel's time on ResNet's 112x112x64 map). Output rows are shared out by OpenMP (the libgomp
 * torch loaded).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMENTS 16384 /* below this one thread beats waking the others */

void cuvil_max_pool2d_nhwc(const float *x, int64_t batch, int64_t height, int64_t width,
                           int64_t channels, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                           int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t out_h,
                           int64_t out_w, float *out, int threads)
{
    const int64_t rows = batch * out_h;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows * out_w * channels >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = r / out_h, oh = r % out_h;
        const int64_t h0 = oh * stride_h - pad_h;
        const int64_t h_lo = h0 < 0 ? 0 : h0;
        const int64_t h_hi = h0 + kernel_h > height ? height : h0 + kernel_h;
        const float *image = x + n * height * width * channels;
        for (int64_t ow = 0; ow < out_w; ow++) {
            const int64_t w0 = ow * stride_w - pad_w;
            const int64_t w_lo = w0 < 0 ? 0 : w0;
            const int64_t w_hi = w0 + kernel_w > width ? width : w0 + kernel_w;
            float *o = out + (r * out_w + ow) * channels;
#pragma omp simd
            for (int64_t c = 0; c < channels; c++)
                o[c] = -INFINITY;
            for (int64_t ih = h_lo; ih < h_hi; ih++) {
                for (int64_t iw = w_lo; iw < w_hi; iw++) {
                    const float *p = image + (ih * width + iw) * channels;
                    /* NaN propagates, as in torch: a NaN input wins the comparison */
#pragma omp simd
                    for (int64_t c = 0; c < channels; c++)
                        o[c] = (p[c] > o[c] || isnan(p[c])) ? p[c] : o[c];
                }
            }
        }
    }
}

/* bf16 to fp32 and back: a bf16 value is the upper half of an fp32 one, so the maximum of bf16
 * values taken in fp32 is one of them again, exact. */
static inline float bf16_value(uint16_t v)
{
    union { uint32_t bits; float value; } u = {(uint32_t)v << 16};
    return u.value;
}

/* The same pooling over channels-last bf16 tensors (bf16 activations, passes/low_activations.py) */
void cuvil_max_pool2d_nhwc_bf16(const uint16_t *x, int64_t batch, int64_t height, int64_t width,
                                int64_t channels, int64_t kernel_h, int64_t kernel_w,
                                int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                int64_t out_h, int64_t out_w, uint16_t *out, int threads)
{
    const int64_t rows = batch * out_h;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows * out_w * channels >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = r / out_h, oh = r % out_h;
        const int64_t h0 = oh * stride_h - pad_h;
        const int64_t h_lo = h0 < 0 ? 0 : h0;
        const int64_t h_hi = h0 + kernel_h > height ? height : h0 + kernel_h;
        const uint16_t *image = x + n * height * width * channels;
        for (int64_t ow = 0; ow < out_w; ow++) {
            const int64_t w0 = ow * stride_w - pad_w;
            const int64_t w_lo = w0 < 0 ? 0 : w0;
            const int64_t w_hi = w0 + kernel_w > width ? width : w0 + kernel_w;
            uint16_t *o = out + (r * out_w + ow) * channels;
#pragma omp simd
            for (int64_t c = 0; c < channels; c++)
                o[c] = 0xFF80; /* -inf */
            for (int64_t ih = h_lo; ih < h_hi; ih++) {
                for (int64_t iw = w_lo; iw < w_hi; iw++) {
                    const uint16_t *p = image + (ih * width + iw) * channels;
#pragma omp simd
                    for (int64_t c = 0; c < channels; c++) {
                        const float v = bf16_value(p[c]);
                        o[c] = (v > bf16_value(o[c]) || isnan(v)) ? p[c] : o[c];
                    }
                }
            }
        }
    }
}
