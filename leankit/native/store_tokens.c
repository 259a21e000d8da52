/* leankit's compiled CPU kernel that quantizes a step's new tokens straight into their page slots.
 *
 * The torch path (leankit.pages: PageLayout.encode, then PagePool.write_rows) runs about twenty
 * small tensor ops per layer for the two dozen tokens a decode step stores (group minima and
 * maxima, the fp16 rounding of the metadata, the codes, their packing, six indexed row stores),
 * and at that size each op costs far more than its arithmetic. Here each token is quantized and
 * written in one pass, with the same result byte for byte (leankit.quant.quantize, LeanKV Eq. 2):
 *
 *   mn16 = fp16(min_g x)             the stored minimum, rounded to nearest even
 *   sc16 = fp16((max_g x - mn16) / qmax)   in fp32, then rounded; qmax = 2^bits - 1
 *          (to nearest, or one unit up where that lands below the step among fp16's subnormals:
 *          leankit.quant.round_scale_up_if_subnormal says why)
 *   Q    = clamp(rint((x - mn16) / sc16), 0, qmax)     0 where sc16 <= 0 (a constant group)
 *
 * codes packed little-endian (code i of byte j is column j * (8 / bits) + i), and per token per
 * group the fp16 pair (sc16, mn16). A dense side (formats.h) stores the values themselves in its
 * format, rounded to nearest even as torch's cast does, with no metadata. The token's score is
 * stored as fp16 (nearest even) and its position as int32.
 *
 * A call first checks every token (page ids, slots, and that each group's stored scale is finite,
 * which fails for NaN/Inf inputs and for values beyond the fp16 range of the metadata) and writes
 * nothing unless all pass, so a refused call leaves the pages as they were.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "kernels.h"
#include "formats.h"
#include "fp16.h"

#define MIN_TOKENS_PER_THREAD 64 /* fewer tokens cost more to hand to a thread than they save */

/* One group's (sc16, mn16) from its n values, or an error code (as a negative int). */
static inline int group_meta(const float *restrict x, int n, int qmax, uint16_t *restrict meta) {
    float lo = x[0], hi = x[0];
    int nan = 0;
    for (int c = 0; c < n; ++c) {
        lo = x[c] < lo ? x[c] : lo;
        hi = x[c] > hi ? x[c] : hi;
        nan |= x[c] != x[c];
    }
    if (nan || isinf(lo) || isinf(hi)) return LK_NON_FINITE;
    uint16_t mn16 = float_to_half(lo);
    if ((mn16 & 0x7fffu) == 0) mn16 = 0; /* a zero minimum is stored as +0, whichever zero came first */
    const float step = (hi - half_to_float(mn16)) / (float)qmax;
    uint16_t sc16 = float_to_half(step);
    if ((sc16 & 0x7fffu) == 0) sc16 = 0; /* a zero step is +0 too (bits: this build ignores signed zeros) */
    /* below 2^-14 (bits < 0x0400, sign clear as step > 0) a scale rounded under the step goes one unit up */
    if (step > 0.0f && sc16 < 0x0400u && half_to_float(sc16) < step) sc16 += 1u;
    if ((sc16 & 0x7c00u) == 0x7c00u) return LK_META_RANGE; /* fp16 Inf or NaN */
    meta[0] = sc16;
    meta[1] = mn16;
    return 0;
}

/* A dense side's n values in its format (fp32 as is; fp16 and bf16 rounded to nearest even). */
static inline void dense_row(const float *restrict x, int n, int bits, uint8_t *restrict out) {
    if (bits == LK_DENSE_F32) {
        memcpy(out, x, sizeof(float) * (size_t)n);
        return;
    }
    for (int c = 0; c < n; ++c) {
        uint16_t h;
        if (bits == LK_DENSE_F16) {
            h = float_to_half(x[c]);
        } else { /* bf16: the top half of the float, rounded to nearest even (x is finite) */
            uint32_t w;
            memcpy(&w, x + c, sizeof w);
            h = (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
        }
        memcpy(out + 2 * c, &h, sizeof h);
    }
}

/* One group's codes from its values and stored (sc16, mn16), packed into out[n * bits / 8]. */
static inline void group_codes(const float *restrict x, int n, int bits, const uint16_t *restrict meta,
                               uint8_t *restrict out) {
    const float sc = half_to_float(meta[0]), mn = half_to_float(meta[1]), qmax = (float)((1 << bits) - 1);
    const int per_byte = 8 / bits;
    for (int j = 0; j < n / per_byte; ++j) {
        unsigned byte = 0;
        for (int i = 0; i < per_byte; ++i) {
            float q = sc > 0.0f ? rintf((x[j * per_byte + i] - mn) / sc) : 0.0f;
            q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
            byte |= (unsigned)q << (i * bits);
        }
        out[j] = (uint8_t)byte;
    }
}

/* Quantize n tokens into their slots. Token i goes to slot slot[i] of page page_id[i] (skipped
 * when page_id[i] < 0); a page is pool + id * page_bytes, whose segments start at seg_off[0..5]
 * (k data, k meta, v data, v meta, score, position: leankit.pages.SEGMENTS). k, v: [n, dim] fp32;
 * pos: [n] int32; score: [n] fp32. Codes are k_bits / v_bits wide (1, 2, 4 or 8) in groups of
 * group_size channels, or the side is dense (k_bits / v_bits a format of formats.h). Returns 0, or
 * an error code with nothing written. */
int lk_store_tokens(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int64_t *restrict page_id,
                    const int64_t *restrict slot, int64_t n, int tokens, int dim, int k_bits, int v_bits,
                    int group_size, const int64_t *restrict seg_off, const float *restrict k,
                    const float *restrict v, const int32_t *restrict pos, const float *restrict score, int threads) {
    const int groups = dim / group_size, bits[2] = {k_bits, v_bits};
    const float *side[2] = {k, v};
    for (int64_t i = 0; i < n; ++i)
        if (page_id[i] >= pool_pages || (page_id[i] >= 0 && (slot[i] < 0 || slot[i] >= tokens))) return LK_BAD_PAGE;
    /* Every group's metadata first, so that nothing is written unless every token can be. */
    uint16_t *meta = malloc(sizeof(uint16_t) * 4 * (size_t)groups * (size_t)(n > 0 ? n : 1));
    if (meta == NULL) return LK_NO_MEMORY;
    int err = 0;
    for (int64_t i = 0; i < n && !err; ++i) {
        if (page_id[i] < 0) continue;
        for (int s = 0; s < 2 && !err; ++s) {
            if (bits[s] > 8) {
                err = lk_all_finite(side[s] + i * dim, dim) ? 0 : LK_NON_FINITE; /* no metadata to catch them */
                continue;
            }
            for (int g = 0; g < groups && !err; ++g)
                err = group_meta(side[s] + i * dim + g * group_size, group_size, (1 << bits[s]) - 1,
                                 meta + ((i * 2 + s) * groups + g) * 2);
        }
    }
    if (!err) {
        if (n < (int64_t)MIN_TOKENS_PER_THREAD * threads) threads = (int)(n / MIN_TOKENS_PER_THREAD);
        if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            if (page_id[i] < 0) continue;
            uint8_t *page = pool + page_id[i] * page_bytes;
            const int64_t t = slot[i];
            for (int s = 0; s < 2; ++s) {
                if (bits[s] > 8) {
                    dense_row(side[s] + i * dim, dim, bits[s], page + seg_off[2 * s] + t * lk_row_bytes(dim, bits[s]));
                    continue;
                }
                const int nb = lk_row_bytes(dim, bits[s]), gb = group_size * bits[s] / 8;
                const uint16_t *m = meta + (i * 2 + s) * groups * 2;
                uint8_t *codes = page + seg_off[2 * s] + t * nb;
                for (int g = 0; g < groups; ++g)
                    group_codes(side[s] + i * dim + g * group_size, group_size, bits[s], m + 2 * g, codes + g * gb);
                memcpy(page + seg_off[2 * s + 1] + t * 4 * groups, m, sizeof(uint16_t) * 2 * groups);
            }
            const uint16_t sc = float_to_half(score[i]);
            memcpy(page + seg_off[4] + 2 * t, &sc, sizeof sc);
            memcpy(page + seg_off[5] + 4 * t, pos + i, sizeof pos[i]);
        }
    }
    free(meta);
    return err;
}
