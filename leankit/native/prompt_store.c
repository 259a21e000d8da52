/* leankit's compiled CPU prompt store of the LeanKV policy: one layer's prompt classified per
 * (sequence, KV head) and its kept tokens written straight into their tiers.
 *
 * On the torch path a short prompt's layer spends about 1 ms here against the model's 0.15 ms of
 * attention: the classification (leankit.policy.plan_unified's prompt-phase rule) is about sixty
 * small tensor ops and the store of each tier a dozen more, each costing far more than its
 * arithmetic at that size. This is the CPU twin of leankit_kernels.prompt_plan (classes, ranks,
 * counts, pruned mass) and leankit_kernels.quant.store_step_tokens (the ranked store):
 *
 *   significance  s_t = fp16(received_t / max(q_last - pos_t + 1, 1)), as the page keeps it;
 *   cut-offs      (leankit.policy.significance_cutoffs) the candidates' finite scores sorted
 *                 ascending, C_i = (pruned_mass + sum_{j <= i} s_(j)) / Z with the prefix sum
 *                 accumulated in double and rounded to fp32 at each step, as torch's CPU cumsum
 *                 does; tau_T = the first s_(i) with C_i >= T, else +inf;
 *   classes       (Algorithm 1, lines 5-6 / 13-14) s >= tau_h high, s >= tau_l low, else pruned;
 *                 tokens in the window (pos > q_last - W) high; padding -1;
 *   ranks         each kept token's index among its head's kept tokens of its tier, in arrival
 *                 order: the store puts it that many slots past the head's count.
 *
 * Z (the head's valid scores plus its pruned mass) and the pruned mass are summed in double here
 * and in fp32 blocks by torch, so a token whose cumulative significance lies within fp32 rounding
 * of a threshold may fall on the other side of it (as with the GPU kernel).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "fp16.h"
#include "kernels.h"

enum { KEEP_HIGH = 0, KEEP_LOW = 1, PRUNED = 2 }; /* leankit.policy's classes */

/* Sort n finite fp16 values (given by their bits) ascending, in two byte-wide radix passes over
 * keys that order as the values do (negative halves flipped whole, non-negative ones with the
 * sign bit set). tmp holds n entries. */
static void sort_halves(uint16_t *restrict bits, uint16_t *restrict tmp, int64_t n) {
    for (int64_t i = 0; i < n; ++i) bits[i] = (bits[i] & 0x8000u) ? (uint16_t)~bits[i] : (uint16_t)(bits[i] | 0x8000u);
    uint16_t *src = bits, *dst = tmp;
    for (int shift = 0; shift < 16; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; ++i) ++count[((src[i] >> shift) & 0xffu) + 1];
        for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; ++i) dst[count[(src[i] >> shift) & 0xffu]++] = src[i];
        uint16_t *swap = src;
        src = dst;
        dst = swap;
    }
    /* two passes: the sorted keys are back in bits */
    for (int64_t i = 0; i < n; ++i) bits[i] = (bits[i] & 0x8000u) ? (uint16_t)(bits[i] & 0x7fffu) : (uint16_t)~bits[i];
}

/* The smallest cut-offs tau_l, tau_h (fp32, +inf where none) of n sorted candidate values (see
 * the top of this file). */
static void cutoffs(const uint16_t *restrict sorted, int64_t n, float pm, float z, float tl, float th,
                    float *restrict tau_l, float *restrict tau_h) {
    double acc = 0.0;
    int have_l = 0, have_h = 0;
    *tau_l = *tau_h = INFINITY;
    for (int64_t i = 0; i < n && !(have_l && have_h); ++i) {
        const float s = half_to_float(sorted[i]);
        acc += (double)s;
        const float cum = (pm + (float)acc) / z;
        if (!have_l && cum >= tl) {
            *tau_l = s;
            have_l = 1;
        }
        if (!have_h && cum >= th) {
            *tau_h = s;
            have_h = 1;
        }
    }
}

/* Classify every (b, h) head's nq prompt tokens (see the top of this file). received fp32 at
 * strides (s_rb, s_rh, s_rq); q_pos int64 and real uint8 [B, nq]; q_last int64 [B]; pruned_mass fp32
 * [B * H]; lens int32 at strides (s_lt, s_lb, s_lh): the heads' counts per tier before the prompt.
 * Writes score fp32, cls int8 and rank int64 [B * H * nq], new_lens int64 [2, B * H] and pruned
 * fp32 [B * H]. Returns 0 or LK_NO_MEMORY. */
int lk_prompt_classes(const float *restrict received, int64_t s_rb, int64_t s_rh, int64_t s_rq,
                      const int64_t *restrict q_pos, const uint8_t *restrict real, const int64_t *restrict q_last,
                      const float *restrict pruned_mass, const int32_t *restrict lens, int64_t s_lt, int64_t s_lb,
                      int64_t s_lh, int64_t batch, int64_t heads, int64_t nq, int64_t window, double th, double tl,
                      float *restrict score, int8_t *restrict cls, int64_t *restrict rank, int64_t *restrict new_lens,
                      float *restrict pruned) {
    uint16_t *scratch = malloc(sizeof(uint16_t) * 2 * (size_t)(nq > 0 ? nq : 1));
    if (scratch == NULL) return LK_NO_MEMORY;
    const float th_f = (float)th, tl_f = (float)tl; /* the thresholds as fp32, as torch compares them */
    const int64_t bh_total = batch * heads;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t *pos = q_pos + b * nq;
        const uint8_t *is_real = real + b * nq;
        const int64_t last = q_last[b];
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t bh = b * heads + h, base = bh * nq;
            const float *rec = received + b * s_rb + h * s_rh;
            float *s = score + base;
            double total = 0.0;
            int64_t n_cand = 0;
            for (int64_t q = 0; q < nq; ++q) {
                const int64_t seen = last - pos[q] + 1;
                const uint16_t s16 = float_to_half(rec[q * s_rq] / (float)(seen > 1 ? seen : 1));
                s[q] = half_to_float(s16);
                if (!is_real[q]) continue;
                total += (double)s[q];
                if (pos[q] <= last - window && (s16 & 0x7c00u) != 0x7c00u) scratch[n_cand++] = s16; /* finite */
            }
            const float pm = pruned_mass[bh];
            float z = (float)total + pm;
            z = z > 0.0f ? z : 1.0f;
            float tau_l, tau_h;
            sort_halves(scratch, scratch + nq, n_cand);
            cutoffs(scratch, n_cand, pm, z, tl_f, th_f, &tau_l, &tau_h);
            int64_t n_h = 0, n_l = 0;
            double lost = 0.0;
            for (int64_t q = 0; q < nq; ++q) {
                int8_t c;
                if (!is_real[q])
                    c = -1;
                else if (pos[q] > last - window)
                    c = KEEP_HIGH;
                else
                    c = s[q] >= tau_h ? KEEP_HIGH : (s[q] >= tau_l ? KEEP_LOW : PRUNED); /* NaN: pruned */
                n_h += c == KEEP_HIGH;
                n_l += c == KEEP_LOW;
                cls[base + q] = c;
                rank[base + q] = (c == KEEP_LOW ? n_l : n_h) - 1;
                if (c == PRUNED) lost += (double)s[q];
            }
            new_lens[bh] = (int64_t)lens[b * s_lb + h * s_lh] + n_h;
            new_lens[bh_total + bh] = (int64_t)lens[s_lt + b * s_lb + h * s_lh] + n_l;
            pruned[bh] = (float)lost;
        }
    }
    free(scratch);
    return 0;
}

/* Store the tokens of class want of every (b, h) head (bh = b * heads_per_seq + h) into their
 * tier: token (bh, q) goes to slot lens[bh] + rank[bh, q] of its head, on the page in column
 * first_col + col_step * (slot / tokens) of its row of table (int32 [BH, row_len]), with position
 * q_pos[b, q] and significance score[bh, q]; byte for byte what lk_store_tokens writes. k, v fp32
 * [BH * nq, dim]. lens is not advanced (the caller sets the new counts). Returns 0, or an error code
 * with nothing written (LK_BAD_PAGE: a kept token's slot has no page in its row). */
int lk_store_ranked(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int32_t *restrict table,
                    int64_t row_len, int64_t first_col, int64_t col_step, const int32_t *restrict lens, int64_t heads,
                    int64_t heads_per_seq, int64_t nq, int tokens, int dim, int k_bits, int v_bits, int group_size,
                    const int64_t *restrict seg_off, const float *restrict k, const float *restrict v,
                    const int64_t *restrict q_pos, const int8_t *restrict cls, const int64_t *restrict rank, int want,
                    const float *restrict score, int threads) {
    const int64_t n = heads * nq;
    if (n <= 0) return 0;
    int64_t *where = malloc(sizeof(int64_t) * 2 * (size_t)n);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    int err = where == NULL || pos == NULL ? LK_NO_MEMORY : 0;
    int64_t *page_id = where, *slot = where ? where + n : NULL;
    for (int64_t i = 0; i < n && !err; ++i) {
        const int64_t bh = i / nq, p = q_pos[(bh / heads_per_seq) * nq + i % nq];
        pos[i] = p > INT32_MAX ? INT32_MAX : (p < INT32_MIN ? INT32_MIN : (int32_t)p);
        page_id[i] = -1;
        slot[i] = 0;
        if (cls[i] != want) continue;
        const int64_t at = (int64_t)lens[bh] + rank[i], col = first_col + col_step * (at / tokens);
        if (at < 0 || col < 0 || col >= row_len || table[bh * row_len + col] < 0) {
            err = LK_BAD_PAGE;
            break;
        }
        page_id[i] = table[bh * row_len + col];
        slot[i] = at % tokens;
    }
    if (!err)
        err = lk_store_tokens(pool, page_bytes, pool_pages, page_id, slot, n, tokens, dim, k_bits, v_bits, group_size,
                              seg_off, k, v, pos, score, threads);
    free(where);
    free(pos);
    return err;
}
