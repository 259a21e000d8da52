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
 * lk_prompt_layer runs a whole layer in one call: the rule, the page plan and its grant
 * (page_grants.c), the ranked store of each tier, the pruned mass and the recycle. Called one by
 * one from Python, those five calls spent more time in their wrappers' checks and allocations than
 * in C at a short prompt's sizes.
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

/* Segment offsets, code widths and page size of a tier, as lk_prompt_layer reads them: one row of
 * PROMPT_TIER_FIELDS int64 (leankit.native.Kernels.prompt_geometry). */
enum { TIER_TOKENS = 0, TIER_K_BITS = 1, TIER_V_BITS = 2, TIER_GROUP = 3, TIER_OFFSETS = 4, PROMPT_TIER_FIELDS = 10 };

/* One LeanKV prompt layer on the CPU, in the order the torch path takes it (LeanKVPolicy.store):
 *
 *   1. lk_prompt_classes: the prompt-phase rule for every (b, h) head of the layer;
 *   2. lk_fit_pages: the plan for the heads' new counts and its grant (layer `layer` only);
 *   3. lk_store_ranked per tier (`tiers`, 1 or 2): the kept tokens of each class into their slots;
 *   4. pruned_mass[bh] += the significance the rule pruned (fp32, as torch's in-place add);
 *   5. lk_settle_pages: the new counts, and every page past the plan's need back to the ring.
 *
 * received, q_pos, real, q_last, window, th, tl: as lk_prompt_classes (pruned_mass fp32 [BH], this
 * layer's row). tables int32 [L, BH, row_len], n_pages and lens int32 [2, L, BH]; the ring of
 * free ids holds ring[c % capacity] for head <= c < tail. pool: pool_pages pages of page_bytes;
 * geometry int64 [tiers, PROMPT_TIER_FIELDS]; k, v fp32 [BH * nq, dim].
 *
 * result int64 [3]: the stage reached (0: nothing changed; 1: pages granted, a store failed; 2:
 * done, or the recycle failed), the pages granted (asked for, at stage 0) and the pages returned
 * to the ring at tail. Returns 0 or the failing step's error code: at stage 0 the grant's
 * refusals (LK_ROW_FULL, LK_POOL_SHORT) or LK_NO_MEMORY, at stage 1 the store's (LK_BAD_PAGE,
 * LK_NON_FINITE, LK_META_RANGE; a tier stored before the failing one keeps its bytes, and no count
 * has moved), at stage 2 the recycle's. */
int lk_prompt_layer(const float *restrict received, int64_t s_rb, int64_t s_rh, int64_t s_rq,
                    const int64_t *restrict q_pos, const uint8_t *restrict real, const int64_t *restrict q_last,
                    float *restrict pruned_mass, int64_t batch, int64_t heads_per_seq, int64_t nq, int64_t window,
                    double th, double tl, int32_t *restrict tables, int32_t *restrict n_pages, int32_t *restrict lens,
                    int64_t layers_total, int64_t row_len, int64_t layer, int tiers, int32_t *restrict ring,
                    int64_t capacity, int64_t head, int64_t tail, uint8_t *restrict pool, int64_t page_bytes,
                    int64_t pool_pages, const int64_t *restrict geometry, int dim, const float *restrict k,
                    const float *restrict v, int threads, int64_t *restrict result) {
    const int64_t heads = batch * heads_per_seq, n = heads * nq, rows = layers_total * heads;
    result[0] = result[1] = result[2] = 0;
    if (layer < 0 || layer >= layers_total || tiers < 1 || tiers > 2) return LK_BAD_MOVE;
    const size_t cells = (size_t)(n > 0 ? n : 1), per_head = (size_t)(heads > 0 ? heads : 1);
    float *score = malloc(sizeof(float) * cells), *pruned = malloc(sizeof(float) * per_head);
    int8_t *cls = malloc(cells);
    int64_t *rank = malloc(sizeof(int64_t) * cells), *counts = malloc(sizeof(int64_t) * 4 * per_head);
    int err = score == NULL || pruned == NULL || cls == NULL || rank == NULL || counts == NULL ? LK_NO_MEMORY : 0;
    int64_t *new_lens = counts, *need = counts + 2 * per_head; /* [2, BH] each: high row, then low */
    int64_t taken = 0, freed = 0;
    if (!err) /* 1: the counts before the prompt are this layer's, at strides (tier, b, h) */
        err = lk_prompt_classes(received, s_rb, s_rh, s_rq, q_pos, real, q_last, pruned_mass, lens + layer * heads,
                                rows, heads_per_seq, 1, batch, heads_per_seq, nq, window, th, tl, score, cls, rank,
                                new_lens, pruned);
    if (!err) /* 2: refused (nothing changed), or the pages granted from the ring's head */
        err = lk_fit_pages(tables, n_pages, layers_total, heads, heads_per_seq, row_len, &layer, 1, new_lens, tiers,
                           NULL, geometry[TIER_TOKENS], tiers > 1 ? geometry[PROMPT_TIER_FIELDS + TIER_TOKENS] : 1,
                           ring, capacity, head, tail, need, &taken);
    result[1] = taken;
    if (!err) {
        result[0] = 1;
        for (int t = 0; t < tiers && !err; ++t) { /* 3: high pages from a row's left, low ones from its right */
            const int64_t *g = geometry + t * PROMPT_TIER_FIELDS;
            err = lk_store_ranked(pool, page_bytes, pool_pages, tables + layer * heads * row_len, row_len,
                                  t == 0 ? 0 : row_len - 1, t == 0 ? 1 : -1, lens + t * rows + layer * heads, heads,
                                  heads_per_seq, nq, (int)g[TIER_TOKENS], dim, (int)g[TIER_K_BITS],
                                  (int)g[TIER_V_BITS], (int)g[TIER_GROUP], g + TIER_OFFSETS, k, v, q_pos, cls, rank,
                                  t == 0 ? KEEP_HIGH : KEEP_LOW, score, threads);
        }
    }
    if (!err) {
        result[0] = 2;
        for (int64_t i = 0; i < heads; ++i) pruned_mass[i] += pruned[i]; /* 4 */
        err = lk_settle_pages(tables, n_pages, lens, layers_total, heads, row_len, &layer, 1, new_lens, need, ring,
                              capacity, head + taken, tail, &freed); /* 5 */
        result[2] = err ? 0 : freed;
    }
    free(score);
    free(pruned);
    free(cls);
    free(rank);
    free(counts);
    return err;
}
