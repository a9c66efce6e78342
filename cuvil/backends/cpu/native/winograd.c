/* Winograd F(4x4, 3x3) transforms for stride-1 3x3 convolutions on channels-last fp32 tensors.
 *
 * A 3x3 convolution over a 6x6 input tile yields a 4x4 output tile; Winograd's algorithm does
 * it with 36 multiplies per (tile, input channel, output channel) instead of 144. The multiplies
 * become 36 independent GEMMs ([tiles x C_in] @ [C_in x C_out], run by torch.bmm); this file
 * holds the two transforms around them, which are memory-bound and would cost several passes
 * over memory as torch ops:
 *
 *   input:  V[ab][p][c] = (B^T d_p B)[a][b]  for every 6x6 tile d_p of the zero-padded input
 *   output: out[tile p] = act((A^T M_p A) + bias [+ residual])
 *
 * with B^T, A^T the F(4,3) matrices of Lavin & Gray (2015), interpolation points 0, +-1, +-2.
 * The weight side, G g G^T, is done once in Python. Loops run over channels innermost, so the
 * compiler vectorises them; tiles are shared out by OpenMP (the libgomp torch loaded).
 */
#include <stdint.h>
#include <string.h>

#define CB 64 /* channels per block: one tile's 36 x CB floats stay in L1 */

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_RELU6 = 2 };

/* r = B^T d along one dimension of six rows of n floats, the rows `stride` floats apart */
static inline void bt_rows(const float *d, int64_t stride, float *r, int64_t rstride, int n)
{
    const float *d0 = d, *d1 = d + stride, *d2 = d + 2 * stride;
    const float *d3 = d + 3 * stride, *d4 = d + 4 * stride, *d5 = d + 5 * stride;
    float *r0 = r, *r1 = r + rstride, *r2 = r + 2 * rstride;
    float *r3 = r + 3 * rstride, *r4 = r + 4 * rstride, *r5 = r + 5 * rstride;
    for (int c = 0; c < n; c++) {
        float a = d4[c] - 4.0f * d2[c], b = d3[c] - 4.0f * d1[c];
        float e = d4[c] - d2[c], f = 2.0f * (d3[c] - d1[c]);
        r0[c] = 4.0f * d0[c] - 5.0f * d2[c] + d4[c];
        r1[c] = a + b;
        r2[c] = a - b;
        r3[c] = e + f;
        r4[c] = e - f;
        r5[c] = 4.0f * d1[c] - 5.0f * d3[c] + d5[c];
    }
}

/* r = A^T m along one dimension: six rows in, four out */
static inline void at_rows(const float *m, int64_t stride, float *r, int64_t rstride, int n)
{
    const float *m0 = m, *m1 = m + stride, *m2 = m + 2 * stride;
    const float *m3 = m + 3 * stride, *m4 = m + 4 * stride, *m5 = m + 5 * stride;
    float *r0 = r, *r1 = r + rstride, *r2 = r + 2 * rstride, *r3 = r + 3 * rstride;
    for (int c = 0; c < n; c++) {
        float s12 = m1[c] + m2[c], d12 = m1[c] - m2[c];
        float s34 = m3[c] + m4[c], d34 = m3[c] - m4[c];
        r0[c] = m0[c] + s12 + s34;
        r1[c] = d12 + 2.0f * d34;
        r2[c] = s12 + 4.0f * s34;
        r3[c] = d12 + 8.0f * d34 + m5[c];
    }
}

/* x: [n, h, w, c]; v: [36, count, c] for tiles first .. first + count - 1 of the
 * n * tiles_h * tiles_w tiles (image-major, then rows, then columns) */
void cuvil_winograd_input(const float *x, int64_t h, int64_t w, int64_t c, int64_t pad_top,
                          int64_t pad_left, int64_t tiles_h, int64_t tiles_w, int64_t first,
                          int64_t count, float *v, int threads)
{
    const int64_t tiles = count;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i_tile = 0; i_tile < count; i_tile++) {
        float d[36 * CB], t[36 * CB], u[36 * CB];
        const int64_t p = first + i_tile;
        const int64_t image = p / (tiles_h * tiles_w);
        const int64_t ty = (p / tiles_w) % tiles_h, tx = p % tiles_w;
        const int64_t y0 = ty * 4 - pad_top, x0 = tx * 4 - pad_left;
        for (int64_t c0 = 0; c0 < c; c0 += CB) {
            const int nc = (int)(c - c0 < CB ? c - c0 : CB);
            for (int i = 0; i < 6; i++) {
                for (int j = 0; j < 6; j++) {
                    float *dst = d + (i * 6 + j) * CB;
                    const int64_t yy = y0 + i, xx = x0 + j;
                    if (yy < 0 || yy >= h || xx < 0 || xx >= w)
                        memset(dst, 0, sizeof(float) * nc);
                    else
                        memcpy(dst, x + ((image * h + yy) * w + xx) * c + c0, sizeof(float) * nc);
                }
            }
            for (int j = 0; j < 6; j++) /* columns: t[a][j] = sum_i B^T[a][i] d[i][j] */
                bt_rows(d + j * CB, 6 * CB, t + j * CB, 6 * CB, nc);
            for (int a = 0; a < 6; a++) /* rows: u[a][b] = sum_j t[a][j] B[j][b] */
                bt_rows(t + a * 6 * CB, CB, u + a * 6 * CB, CB, nc);
            for (int ab = 0; ab < 36; ab++)
                memcpy(v + (ab * tiles + i_tile) * c + c0, u + ab * CB, sizeof(float) * nc);
        }
    }
}

/* m: [36, count, k] for tiles first .. first + count - 1; out and residual: [n, oh, ow, k];
 * bias: [k] or NULL; residual may be out */
void cuvil_winograd_output(const float *m, const float *bias, const float *residual, float *out,
                           int64_t oh, int64_t ow, int64_t k, int64_t tiles_h, int64_t tiles_w,
                           int64_t first, int64_t count, int activation, int threads)
{
    const int64_t tiles = count;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i_tile = 0; i_tile < count; i_tile++) {
        float g[36 * CB], t[24 * CB], y[16 * CB];
        const int64_t p = first + i_tile;
        const int64_t image = p / (tiles_h * tiles_w);
        const int64_t ty = (p / tiles_w) % tiles_h, tx = p % tiles_w;
        for (int64_t k0 = 0; k0 < k; k0 += CB) {
            const int nk = (int)(k - k0 < CB ? k - k0 : CB);
            for (int ab = 0; ab < 36; ab++)
                memcpy(g + ab * CB, m + (ab * tiles + i_tile) * k + k0, sizeof(float) * nk);
            for (int b = 0; b < 6; b++) /* t[q][b] = sum_a A^T[q][a] g[a][b] */
                at_rows(g + b * CB, 6 * CB, t + b * CB, 6 * CB, nk);
            for (int q = 0; q < 4; q++) /* y[q][r] = sum_b t[q][b] A[b][r] */
                at_rows(t + q * 6 * CB, CB, y + q * 4 * CB, CB, nk);
            for (int q = 0; q < 4; q++) {
                const int64_t yy = ty * 4 + q;
                if (yy >= oh)
                    break;
                for (int r = 0; r < 4; r++) {
                    const int64_t xx = tx * 4 + r;
                    if (xx >= ow)
                        break;
                    const int64_t at = ((image * oh + yy) * ow + xx) * k + k0;
                    const float *src = y + (q * 4 + r) * CB;
                    float *dst = out + at;
                    const float *res = residual ? residual + at : 0;
                    for (int c = 0; c < nk; c++) {
                        float value = src[c] + (bias ? bias[k0 + c] : 0.0f);
                        if (res)
                            value += res[c];
                        if (activation == ACT_RELU)
                            value = value > 0.0f ? value : 0.0f;
                        else if (activation == ACT_RELU6)
                            value = value > 0.0f ? (value < 6.0f ? value : 6.0f) : 0.0f;
                        dst[c] = value;
                    }
                }
            }
        }
    }
}
