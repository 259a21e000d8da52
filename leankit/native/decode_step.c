/* leankit's compiled decode step of one layer: its attention in one call, its store in another.
 *
 * A decode step runs the same short sequence of kernels in every layer: list each tier's live
 * pages from the page table, pass 1 (scores) and pass 2 (numerators, value sums) over them, then
 * the step's own token and the normalization (finish_decode.c); after it, the step's new token is
 * quantized into its head's next slot. Called one by one from Python, with the small tensor ops
 * between them (scaling the queries, expanding their positions, zeroing the sums, looking the new
 * slots up in the page table), this fixed work cost more than the passes themselves at short
 * contexts: a few hundred microseconds a layer, most of it in the interpreter and torch's
 * dispatcher, whose code a step's weight matrices have evicted from the caches by the time each
 * layer runs. Here each composition is one call; the kernels are the same functions Python binds
 * one by one, so both routes give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "kernels.h"

/* One tier of one layer as a decode step reads it (leankit.native.DecodeTier mirrors this struct).
 * The tier's page of rank j for (sequence, head) h sits in column first_col + col_step * j of
 * table row h. The listing buffers hold `capacity` pages; scores [capacity, rows, tokens]; pos_out,
 * valid_out and score_out [capacity, tokens], or NULL. n_listed: written, the tier's live pages. */
struct lk_decode_tier {
    const int32_t *n_pages, *table, *lens; /* [BH], [BH, row_len], [BH] */
    int64_t row_len, first_col, col_step, capacity;
    int32_t tokens, k_bits, v_bits, group_size;
    int64_t k_data, k_meta, v_data, v_meta, pos_off, score_off; /* segment offsets in a page */
    int64_t *head, *rank, *page_id;
    float *scores;
    int32_t *pos_out;
    uint8_t *valid_out;
    float *score_out;
    int64_t n_listed;
};

/* The attention of a decode step of one layer: one query per sequence, G = rows query heads per KV
 * head, over every tier's live pages and the step's own token at its exact key and value; what
 * leankit.decode_attention.decode_step_attention computes, call for call.
 *
 * heads: BH = B * Hkv (sequence-major), heads_per_seq: Hkv. q [BH, rows, dim]: the queries in the
 * basis the pages hold (unscaled; [B, Hq, 1, dim] is this layout), scaled here into q_rows (scratch,
 * [BH, rows, dim]); q_pos [B] the step's positions, expanded into row_pos (scratch, int32
 * [BH, rows]); k_new, v_new [BH, dim]; real [B] 0/1. shift and l_sum [BH, rows]: written (each
 * row's maximum, 0 where it sees nothing, and its numerators' sum); out [BH, rows, dim] and lse
 * [BH, rows]: the result; row_weight [BH, rows] and received [BH] when not NULL (finish_decode.c).
 *
 * update_significance: then, LeanKV's running significance of every live slot (Sec. 4), written in
 * place into the pages' score segments (lk_update_scores, from this step's numerators and
 * row_weight): what the policy's update after the attention does, with no listing or slices of
 * the tiers handed back to Python. A decode step's sequence has one query, so its first and last
 * query positions are both q_pos[b], and a sequence whose token is not real keeps its scores.
 * Needs row_weight and every tier's pos_out, valid_out and score_out. Otherwise the pool is only
 * read. A NaN or Inf in q or k_new would leave NaN in the significance for good, past the step the
 * store then refuses, so with update_significance they are checked first, before anything is
 * written: LK_NON_FINITE_QK, the pool untouched. Returns 0 or an error code (errors.h). */
int lk_decode_attention(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, int n_tiers,
                        struct lk_decode_tier *tiers, int64_t heads, int heads_per_seq, int rows, int dim,
                        const float *restrict q, float scale, const int64_t *restrict q_pos,
                        const float *restrict k_new, const float *restrict v_new, const uint8_t *restrict real,
                        float *restrict q_rows, int32_t *restrict row_pos, float *restrict shift,
                        float *restrict l_sum, float *restrict out, float *restrict lse, float *restrict row_weight,
                        float *restrict received, int update_significance, int threads) {
    const int64_t n_rows = heads * rows;
    if (update_significance && !(lk_all_finite(q, n_rows * dim) && lk_all_finite(k_new, heads * dim)))
        return LK_NON_FINITE_QK;
    for (int64_t i = 0; i < n_rows * dim; ++i) q_rows[i] = q[i] * scale;
    for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t p = q_pos[i / rows / heads_per_seq];
        row_pos[i] = p > INT32_MAX ? INT32_MAX : (int32_t)p;
        shift[i] = -INFINITY;
        l_sum[i] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)(n_rows * dim));
    for (int t = 0; t < n_tiers; ++t) {
        struct lk_decode_tier *tier = tiers + t;
        const int64_t n = lk_list_pages(tier->n_pages, heads, tier->table, tier->row_len, tier->first_col,
                                        tier->col_step, tier->capacity, tier->head, tier->rank, tier->page_id);
        if (n < 0) return (int)n;
        tier->n_listed = n;
        const int err = lk_live_scores(pool, page_bytes, pool_pages, tier->page_id, tier->head, tier->rank, n,
                                       tier->tokens, dim, rows, tier->k_bits, tier->group_size, tier->k_data,
                                       tier->k_meta, tier->pos_off, tier->score_off, q_rows, row_pos, tier->lens,
                                       tier->scores, shift, tier->pos_out, tier->valid_out, tier->score_out,
                                       threads);
        if (err) return err;
    }
    /* A row that sees nothing keeps the -inf maximum: its numerators are 0 against any shift. */
    for (int64_t i = 0; i < n_rows; ++i)
        if (!isfinite(shift[i])) shift[i] = 0.0f;
    for (int t = 0; t < n_tiers; ++t) {
        const struct lk_decode_tier *tier = tiers + t;
        const int err = lk_live_values(pool, page_bytes, pool_pages, tier->page_id, tier->head, tier->n_listed,
                                       tier->tokens, dim, rows, tier->v_bits, tier->group_size, tier->v_data,
                                       tier->v_meta, tier->scores, shift, l_sum, out, threads);
        if (err) return err;
    }
    lk_finish_decode(heads, rows, dim, heads_per_seq, out, l_sum, shift, q_rows, k_new, v_new, real, out, lse,
                     row_weight, received);
    if (!update_significance) return 0;
    for (int t = 0; t < n_tiers; ++t) {
        const struct lk_decode_tier *tier = tiers + t;
        if (row_weight == NULL || tier->pos_out == NULL || tier->valid_out == NULL || tier->score_out == NULL)
            return LK_NO_SLOTS;
        const int err = lk_update_scores(pool, page_bytes, pool_pages, tier->page_id, tier->head, tier->n_listed,
                                         tier->tokens, rows, tier->score_off, heads_per_seq, tier->scores,
                                         row_weight, tier->pos_out, tier->valid_out, tier->score_out, q_pos, q_pos,
                                         real, threads);
        if (err) return err;
    }
    return 0;
}

/* The store of a decode step of one layer: for each (sequence, head) h of a sequence whose token is
 * real, its new token (k, v [BH, dim], fp32) quantized into slot lens[h] of its tier, whose page is
 * the table's column first_col + col_step * (lens[h] / tokens), with position q_pos[h / heads_per_seq]
 * and significance score[h] (0 when score is NULL); then lens[h] += 1. What lk_store_tokens writes
 * for the same tokens, with their pages looked up here instead of by a dozen tensor ops. A slot
 * without a page (the step's pages are reserved before it runs), like a refused store, writes
 * nothing and leaves lens as it was. Returns 0 or an error code (errors.h). */
int lk_store_step(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int32_t *restrict table,
                  int64_t row_len, int64_t first_col, int64_t col_step, int32_t *restrict lens, int64_t heads,
                  int heads_per_seq, int tokens, int dim, int k_bits, int v_bits, int group_size,
                  const int64_t *restrict seg_off, const float *restrict k, const float *restrict v,
                  const int64_t *restrict q_pos, const uint8_t *restrict real, const float *restrict score,
                  int threads) {
    if (heads <= 0) return 0;
    int64_t *where = malloc(sizeof(int64_t) * 2 * (size_t)heads);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)heads);
    float *zeros = score ? NULL : calloc((size_t)heads, sizeof(float));
    int err = where == NULL || pos == NULL || (score == NULL && zeros == NULL) ? LK_NO_MEMORY : 0;
    int64_t *page_id = where, *slot = where ? where + heads : NULL;
    for (int64_t h = 0; h < heads && !err; ++h) {
        const int64_t b = h / heads_per_seq, p = q_pos[b];
        pos[h] = p > INT32_MAX ? INT32_MAX : (int32_t)p;
        page_id[h] = -1;
        slot[h] = 0;
        if (!real[b]) continue;
        const int64_t col = first_col + col_step * (lens[h] / tokens);
        if (lens[h] < 0 || col < 0 || col >= row_len || table[h * row_len + col] < 0) {
            err = LK_BAD_PAGE;
            break;
        }
        page_id[h] = table[h * row_len + col];
        slot[h] = lens[h] % tokens;
    }
    if (!err)
        err = lk_store_tokens(pool, page_bytes, pool_pages, page_id, slot, heads, tokens, dim, k_bits, v_bits,
                              group_size, seg_off, k, v, pos, score ? score : zeros, threads);
    if (!err)
        for (int64_t h = 0; h < heads; ++h) lens[h] += real[h / heads_per_seq] != 0;
    free(where);
    free(pos);
    free(zeros);
    return err;
}
