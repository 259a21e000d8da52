/* leankit's compiled CPU page accounting: the bidirectional page table's plan, grant, hand-over
 * and recycle (LeanKV §5.2-5.3, Fig. 5) in one pass each.
 *
 * The torch path (leankit.page_table) runs each of them as ten to twenty tensor ops (a prefix sum
 * for the ring offsets, repeat_interleave for the owners, indexed loads and stores of the table
 * rows). On a CPU a prompt's layer or a decode step asks for a handful of pages, and each op costs
 * far more than the work it does: about 0.4 ms of a layer's store at 64 tokens. Here each is one
 * loop over the (tier, layer, sequence, head) rows in the same order, so the same page ids land in
 * the same columns as on the torch path (tests/test_native_page_grants.py checks both):
 *
 *   grant:   row i of tier t takes ring slots head + offset(t, i) ..  (offset: the exclusive prefix
 *            sum of the demand over tier-major rows), into columns n_pages .. n_pages + extra - 1
 *            of its side (high: column j from the left, low: from the right);
 *   recycle: the pages past keep of each side go back to the ring at tail, in the same order;
 *   hand-over (move_tail): the last r high pages of a row become its next r low pages, newest low
 *            first in the order they were high;
 *   plan:    need_t = ceil(tokens_t / T_t), r = min((cur_h - need_h)+, (need_l - cur_l)+),
 *            extra_h = (need_h - cur_h)+, extra_l = (need_l - cur_l - r)+.
 *
 * Every call checks its whole input before it writes, so a refused call changes nothing.
 */
#include <stdint.h>
#include <stdlib.h>

#include "errors.h"
#include "kernels.h"

/* Column of the j-th page of a side: high pages from the left, low pages from the right. */
static inline int64_t side_column(int tier, int64_t j, int64_t row_len) { return tier == 0 ? j : row_len - 1 - j; }

/* ceil(a / b) for b > 0 and any sign of a, as leankit.page_table.ceil_div (-floor(-a / b)). */
static inline int64_t ceil_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return q + (q * b < a);
}

/* Grant extra[t * rows + i] pages to row i (rows = L * B * H) of side t from the ring, whose free
 * ids are ring[c % capacity] for head <= c < tail. tables int32 [rows, row_len], n_pages int32
 * [2, rows] (advanced). *taken: the pages asked for. Returns 0, LK_NEGATIVE_DEMAND, LK_ROW_FULL
 * (a row would hold more pages than it has columns) or LK_POOL_SHORT, checked in that order, as
 * the torch path checks them; a demand of no pages returns 0 before the row check. */
int lk_grant_pages(int32_t *restrict tables, int32_t *restrict n_pages, const int32_t *restrict extra, int64_t rows,
                   int64_t row_len, const int32_t *restrict ring, int64_t capacity, int64_t head, int64_t tail,
                   int64_t *restrict taken) {
    int64_t total = 0;
    int negative = 0, full = 0;
    for (int64_t i = 0; i < rows; ++i) {
        int64_t e_h = extra[i], e_l = extra[rows + i];
        negative |= (e_h < 0) | (e_l < 0);
        total += e_h + e_l;
        full |= (int64_t)n_pages[i] + n_pages[rows + i] + e_h + e_l > row_len;
    }
    *taken = total;
    if (negative) return LK_NEGATIVE_DEMAND;
    if (total == 0) return 0;
    if (full) return LK_ROW_FULL;
    if (total > tail - head) return LK_POOL_SHORT;
    int64_t next = head;
    for (int tier = 0; tier < 2; ++tier) {
        for (int64_t i = 0; i < rows; ++i) {
            int32_t *count = n_pages + tier * rows + i;
            int32_t *row = tables + i * row_len;
            for (int64_t j = *count, end = *count + extra[tier * rows + i]; j < end; ++j)
                row[side_column(tier, j, row_len)] = ring[next++ % capacity];
            *count += extra[tier * rows + i];
        }
    }
    return 0;
}

/* Recycle the pages past keep[t * rows + i] (<= n_pages, the caller's minimum) of each side: back
 * to the ring at tail, their columns cleared, n_pages set to keep. *freed: the pages returned.
 * Returns 0, or LK_DOUBLE_FREE where more pages would come back than are handed out
 * (tail - head free of capacity), with nothing changed. */
int lk_recycle_pages(int32_t *restrict tables, int32_t *restrict n_pages, const int32_t *restrict keep, int64_t rows,
                     int64_t row_len, int32_t *restrict ring, int64_t capacity, int64_t head, int64_t tail,
                     int64_t *restrict freed) {
    int64_t total = 0;
    for (int64_t i = 0; i < 2 * rows; ++i) total += (int64_t)n_pages[i] - keep[i];
    *freed = total;
    if (total == 0) return 0;
    if (total > capacity - (tail - head)) return LK_DOUBLE_FREE;
    int64_t next = tail;
    for (int tier = 0; tier < 2; ++tier) {
        for (int64_t i = 0; i < rows; ++i) {
            int32_t *count = n_pages + tier * rows + i;
            int32_t *row = tables + i * row_len;
            for (int64_t j = keep[tier * rows + i]; j < *count; ++j) {
                int64_t col = side_column(tier, j, row_len);
                ring[next++ % capacity] = row[col];
                row[col] = -1;
            }
            *count = keep[tier * rows + i];
        }
    }
    return 0;
}

/* Hand the last r[l', bh] high pages of each row of layers[l'] to its low side (LeanKV Fig. 5: a
 * downgrade reuses the pages it empties): the high page of rank cur_h - 1 - i becomes low page
 * cur_l + i. The columns read are cleared before the new ones are written, as the two ranges may
 * overlap in a full row. tables int32 [L, BH, row_len], n_pages int32 [2, L, BH] (both moved).
 * Returns 0, or LK_BAD_MOVE (nothing moved) where some r is negative, exceeds the row's high
 * pages or would run the low side past the row, or a layer lies outside [0, L). */
int lk_move_tail(int32_t *restrict tables, int32_t *restrict n_pages, int64_t layers_total, int64_t heads,
                 int64_t row_len, const int64_t *restrict layers, int64_t n_layers, const int64_t *restrict r) {
    int64_t longest = 0;
    for (int64_t li = 0; li < n_layers; ++li) {
        if (layers[li] < 0 || layers[li] >= layers_total) return LK_BAD_MOVE;
        for (int64_t h = 0; h < heads; ++h) {
            int64_t row = layers[li] * heads + h, m = r[li * heads + h];
            int64_t cur_h = n_pages[row], cur_l = n_pages[layers_total * heads + row];
            if (m < 0 || m > cur_h || cur_h + cur_l > row_len) return LK_BAD_MOVE;
            longest = m > longest ? m : longest;
        }
    }
    if (longest == 0) return 0;
    int32_t *moved = malloc((size_t)longest * sizeof(int32_t));
    if (!moved) return LK_NO_MEMORY;
    for (int64_t li = 0; li < n_layers; ++li) {
        for (int64_t h = 0; h < heads; ++h) {
            int64_t row = layers[li] * heads + h, m = r[li * heads + h];
            if (m == 0) continue;
            int32_t *ids = tables + row * row_len, *cur_h = n_pages + row, *cur_l = n_pages + layers_total * heads + row;
            for (int64_t i = 0; i < m; ++i) {
                int64_t col = side_column(0, *cur_h - 1 - i, row_len);
                moved[i] = ids[col];
                ids[col] = -1;
            }
            for (int64_t i = 0; i < m; ++i) ids[side_column(1, *cur_l + i, row_len)] = moved[i];
            *cur_h -= (int32_t)m;
            *cur_l += (int32_t)m;
        }
    }
    free(moved);
    return 0;
}

/* The page plan of a re-tiering (see the top of this file) for the rows of layers[l'] (n_layers of
 * them, distinct), whose heads will hold lens[t, l', bh] tokens in side t (tiers = 1 or 2 sides
 * given; one side needs no low pages) plus reserve[bh / heads_per_seq] high slots (NULL: none).
 * n_pages int32 [2, L, BH]. Writes need int64 [2, L', BH], r int64 [L', BH] and extra int32
 * [2, L, BH] (zero outside layers). Returns 0, or LK_BAD_MOVE for a layer outside [0, L). */
int lk_plan_pages(const int32_t *restrict n_pages, int64_t layers_total, int64_t heads, int64_t heads_per_seq,
                  const int64_t *restrict layers, int64_t n_layers, const int64_t *restrict lens, int tiers,
                  const int64_t *restrict reserve, int64_t tokens_high, int64_t tokens_low, int64_t *restrict need,
                  int64_t *restrict r, int32_t *restrict extra) {
    for (int64_t li = 0; li < n_layers; ++li)
        if (layers[li] < 0 || layers[li] >= layers_total) return LK_BAD_MOVE;
    int64_t rows = layers_total * heads, picked = n_layers * heads;
    for (int64_t i = 0; i < 2 * rows; ++i) extra[i] = 0;
    for (int64_t li = 0; li < n_layers; ++li) {
        for (int64_t h = 0; h < heads; ++h) {
            int64_t at = li * heads + h, row = layers[li] * heads + h;
            int64_t len_h = lens[at] + (reserve ? reserve[h / heads_per_seq] : 0);
            int64_t need_h = ceil_div(len_h, tokens_high);
            int64_t need_l = tiers > 1 ? ceil_div(lens[picked + at], tokens_low) : 0;
            int64_t cur_h = n_pages[row], cur_l = tiers > 1 ? n_pages[rows + row] : 0;
            int64_t spare = cur_h - need_h, lack = need_l - cur_l;
            int64_t moved = spare > 0 && lack > 0 ? (spare < lack ? spare : lack) : 0;
            need[at] = need_h;
            need[picked + at] = need_l;
            r[at] = moved;
            extra[row] = (int32_t)(need_h > cur_h ? need_h - cur_h : 0);
            extra[rows + row] = (int32_t)(lack - moved > 0 ? lack - moved : 0);
        }
    }
    return 0;
}

/* lk_plan_pages, then the grant it asks for, in one call (a prompt's layer on the CPU: plan, check,
 * hand-over, grant): surplus high pages to the low side (lk_move_tail), then the extra pages
 * (lk_grant_pages). Both refusals of the grant (LK_ROW_FULL, LK_POOL_SHORT) are checked before
 * the hand-over, which keeps every row's page total, so a refused call changes nothing. Writes
 * need int64 [2, L', BH]; *taken: the pages granted (or asked for, when refused). */
int lk_fit_pages(int32_t *restrict tables, int32_t *restrict n_pages, int64_t layers_total, int64_t heads,
                 int64_t heads_per_seq, int64_t row_len, const int64_t *restrict layers, int64_t n_layers,
                 const int64_t *restrict lens, int tiers, const int64_t *restrict reserve, int64_t tokens_high,
                 int64_t tokens_low, const int32_t *restrict ring, int64_t capacity, int64_t head, int64_t tail,
                 int64_t *restrict need, int64_t *restrict taken) {
    const int64_t rows = layers_total * heads;
    int64_t *r = malloc(sizeof(int64_t) * (size_t)(n_layers * heads > 0 ? n_layers * heads : 1));
    int32_t *extra = malloc(sizeof(int32_t) * 2 * (size_t)(rows > 0 ? rows : 1));
    int err = r == NULL || extra == NULL ? LK_NO_MEMORY : 0;
    if (!err)
        err = lk_plan_pages(n_pages, layers_total, heads, heads_per_seq, layers, n_layers, lens, tiers, reserve,
                            tokens_high, tokens_low, need, r, extra);
    if (!err) { /* the grant's checks, on the totals the hand-over keeps */
        int64_t total = 0;
        int full = 0;
        for (int64_t i = 0; i < rows; ++i) {
            total += (int64_t)extra[i] + extra[rows + i];
            full |= (int64_t)n_pages[i] + n_pages[rows + i] + extra[i] + extra[rows + i] > row_len;
        }
        *taken = total;
        if (total > 0 && full) err = LK_ROW_FULL;
        else if (total > tail - head) err = LK_POOL_SHORT;
    }
    if (!err) err = lk_move_tail(tables, n_pages, layers_total, heads, row_len, layers, n_layers, r);
    if (!err) err = lk_grant_pages(tables, n_pages, extra, rows, row_len, ring, capacity, head, tail, taken);
    free(r);
    free(extra);
    return err;
}

/* The end of a re-tiering of the rows of layers[l'] (distinct): their token counts set to new_lens
 * (int64 [2, L', BH]; lens int32 [2, L, BH]) and every page past need[t, l', bh] (int64, kept as is
 * where it is not below n_pages) recycled as lk_recycle_pages does, in its order (tier, then rows of
 * every layer ascending); rows of other layers keep their pages. *freed: the pages returned.
 * Returns 0, LK_BAD_MOVE (a layer outside [0, L), or a negative need) or LK_DOUBLE_FREE, with nothing
 * changed. */
int lk_settle_pages(int32_t *restrict tables, int32_t *restrict n_pages, int32_t *restrict lens, int64_t layers_total,
                    int64_t heads, int64_t row_len, const int64_t *restrict layers, int64_t n_layers,
                    const int64_t *restrict new_lens, const int64_t *restrict need, int32_t *restrict ring,
                    int64_t capacity, int64_t head, int64_t tail, int64_t *restrict freed) {
    const int64_t rows = layers_total * heads, picked = n_layers * heads;
    int64_t *slot_of = malloc(sizeof(int64_t) * (size_t)(layers_total > 0 ? layers_total : 1));
    if (slot_of == NULL) return LK_NO_MEMORY;
    for (int64_t l = 0; l < layers_total; ++l) slot_of[l] = -1;
    int err = 0;
    for (int64_t li = 0; li < n_layers && !err; ++li) {
        if (layers[li] < 0 || layers[li] >= layers_total) err = LK_BAD_MOVE;
        else slot_of[layers[li]] = li;
    }
    int64_t total = 0;
    for (int tier = 0; tier < 2 && !err; ++tier)
        for (int64_t l = 0; l < layers_total; ++l) {
            if (slot_of[l] < 0) continue;
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t have = n_pages[tier * rows + l * heads + h], keep = need[tier * picked + slot_of[l] * heads + h];
                if (keep < 0) err = LK_BAD_MOVE;
                total += keep < have ? have - keep : 0;
            }
        }
    *freed = total;
    if (!err && total > capacity - (tail - head)) err = LK_DOUBLE_FREE;
    if (!err) {
        int64_t next = tail;
        for (int tier = 0; tier < 2; ++tier)
            for (int64_t l = 0; l < layers_total; ++l) {
                if (slot_of[l] < 0) continue;
                for (int64_t h = 0; h < heads; ++h) {
                    const int64_t row = l * heads + h, at = tier * picked + slot_of[l] * heads + h;
                    int32_t *count = n_pages + tier * rows + row, *ids = tables + row * row_len;
                    for (int64_t j = need[at]; j < *count; ++j) {
                        const int64_t col = side_column(tier, j, row_len);
                        ring[next++ % capacity] = ids[col];
                        ids[col] = -1;
                    }
                    if (need[at] < *count) *count = (int32_t)need[at];
                    lens[tier * rows + row] = (int32_t)new_lens[at];
                }
            }
    }
    free(slot_of);
    return err;
}
