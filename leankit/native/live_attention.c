/* leankit's compiled CPU kernels for decode attention over live pages.
 *
 * The torch path (leankit/decode_attention.py) gathers every live page into a copy, converts every
 * code and every fp16 scale to fp32 in memory before a matmul can read them (4x the bytes the page
 * holds), multiplies one small page at a time, and runs the masks, the softmax and the per-head
 * reductions as a dozen separate tensor ops per tier. These kernels read each page in place in the
 * pool, through its id, once per pass, unpack a token's codes into registers and use them at once:
 *
 *   lk_list_pages   the live pages of one tier: (head, rank, pool id) per page, from the page table;
 *   lk_live_scores  pass 1: masked scaled scores of every live slot and the per-head row maxima;
 *   lk_live_values  pass 2: softmax numerators, their per-head sums and the values' weighted sum;
 *   lk_update_scores  the running significance of the live slots, written back into their pages.
 *
 * Their contract is the torch path's, term for term (LeanKV Eq. 2, factored):
 *
 *   score(r, t) = sum_g s_g(t) (q_rg . Q_g(t)) + m_g(t) sum(q_rg)     if slot t is visible to row r
 *               = -inf                                                otherwise
 *   p(r, t)     = exp(score(r, t) - shift(r))
 *   acc(h, r, :) += sum_t p(r, t) (s_g(t) Q_g(t) + m_g(t))
 *
 * Q are the integer codes of one token, natural column order (code i of byte j is column
 * j * (8 / bits) + i, as leankit.quant.pack lays them out); s and m are the group's fp16 scale and
 * min, converted here. A slot is visible when it holds a stored token (slot index < the tier's
 * length minus the slots of the head's earlier pages) whose position is not after the row's query.
 * Dead slots are never read beyond their position, so stale bytes (NaN patterns included) in them
 * cannot reach any result.
 *
 * Plain C99 with no dependencies, compiled on first use by leankit/native/__init__.py. Where torch
 * runs on GNU OpenMP, it is built with -fopenmp and binds to the libgomp torch has already loaded,
 * so its threads are torch's intra-op threads: one pool, no second set of spinning workers. Both
 * passes split the pages between heads only (a head's pages are handled by one thread, in page
 * order), so every result is the same for any thread count and no two threads write one head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#define THREAD_COUNT omp_get_num_threads()
#else
#define THREAD_ID 0
#define THREAD_COUNT 1
#endif

#define STACK_FLOATS 2048 /* scratch kept on the stack up to this size */
#define MIN_PAGES_PER_THREAD 8 /* fewer pages cost more to hand to a thread than they save */

/* Error codes shared with leankit/native/__init__.py. */
#define LK_NO_MEMORY (-1)
#define LK_BAD_PAGE (-2)   /* a page id outside the pool */
#define LK_UNSORTED (-3)   /* pages not grouped by head */
#define LK_OVERFLOW (-4)   /* more live pages than the output holds */

/* Threads worth using on n_pages, at most `threads`. */
static int team_size(int64_t n_pages, int threads) {
    const int64_t most = n_pages / MIN_PAGES_PER_THREAD;
    if (threads > most) threads = (int)most;
    return threads < 1 ? 1 : threads;
}

/* First page of thread `tid`'s run out of `nth` over n_pages: an even share, moved forward to the
 * first page of a head, so that no head spans two runs (pages grouped by head). */
static int64_t run_start(const int64_t *head, int64_t n_pages, int tid, int nth) {
    int64_t l = n_pages * tid / nth;
    while (l > 0 && l < n_pages && head[l] == head[l - 1]) ++l;
    return l;
}

/* 0 when every page id lies in [0, pool_pages) and pages come grouped by head in ascending order,
 * else the error code. Checked before any write, so a refused call writes nothing. */
static int check_pages(const int64_t *page_id, const int64_t *head, int64_t n_pages, int64_t pool_pages) {
    for (int64_t l = 0; l < n_pages; ++l) {
        if (page_id[l] < 0 || page_id[l] >= pool_pages) return LK_BAD_PAGE;
        if (l && head[l] < head[l - 1]) return LK_UNSORTED;
    }
    return 0;
}

/* IEEE half to float, exact for every input (subnormals, infinities and NaN included). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (mant << 13);
    else if (exp)
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    else if (mant) {
        const float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        return sign ? -f : f;
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float to IEEE half, rounding to nearest even as a float-to-half cast does (overflow to
 * infinity, subnormal halves included); NaN stays NaN. */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u); /* inf, NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  /* 65520 and above round to infinity */
    if (ax < 0x38800000u) {                        /* below 2^-14: a subnormal half (or 0) */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)rintf(a * 16777216.0f); /* units of 2^-24, exact scaling, nearest even */
    }
    uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax >> 13) & 0x3ffu);
    const uint32_t rest = ax & 0x1fffu; /* the 13 dropped bits: round half to even (a carry bumps the exponent) */
    h += rest > 0x1000u || (rest == 0x1000u && (h & 1u));
    return sign | (uint16_t)h;
}

/* One token's scale and min per group, fp16 pairs at src, into fp32 out[2 * groups]. */
static inline void load_meta(const uint8_t *src, int groups, float *out) {
    for (int i = 0; i < 2 * groups; ++i) {
        uint16_t h;
        memcpy(&h, src + 2 * i, sizeof h);
        out[i] = half_to_float(h);
    }
}

/* e^x for the softmax numerators (x <= 0 there), branch-free so a page's numerators vectorize:
 * e^x = 2^n e^r with n = round(x / ln 2) and ln 2 split in two (Cody-Waite), e^r from Cephes'
 * degree-5 minimax polynomial; within a few ulp of expf where FMA is available. 0 below -87
 * (e^x < 2^-125), -inf included. */
static inline float exp_numerator(float x) {
    const float lowest = -87.0f;
    const float xc = x < lowest ? lowest : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
#ifdef __FMA__ /* fused: the compiler's reassociation cannot merge the two halves of ln 2 */
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
#else /* may be merged into one multiply by fp32 ln 2: error then grows to about |x| * 4e-8 relative */
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
#endif
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float er = poly * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < lowest ? 0.0f : er * two_n;
}

/* One token's codes, nb bytes, into fp32 columns out[nb * 8 / bits]. */
static inline void unpack_token(const uint8_t *restrict src, int nb, int bits, float *restrict out) {
    switch (bits) {
    case 8:
        for (int j = 0; j < nb; ++j) out[j] = (float)src[j];
        break;
    case 4:
        for (int j = 0; j < nb; ++j) {
            out[2 * j] = (float)(src[j] & 15);
            out[2 * j + 1] = (float)(src[j] >> 4);
        }
        break;
    case 2:
        for (int j = 0; j < nb; ++j) {
            out[4 * j] = (float)(src[j] & 3);
            out[4 * j + 1] = (float)((src[j] >> 2) & 3);
            out[4 * j + 2] = (float)((src[j] >> 4) & 3);
            out[4 * j + 3] = (float)(src[j] >> 6);
        }
        break;
    default: /* 1 bit */
        for (int j = 0; j < nb; ++j)
            for (int i = 0; i < 8; ++i) out[8 * j + i] = (float)((src[j] >> i) & 1);
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
    for (int c = 0; c < n; ++c) s += a[c] * b[c];
    return s;
}

/* The live pages of one tier. For each (sequence, head) h in order, its n_pages[h] pages by rank
 * j: head[l] = h, rank[l] = j, page_id[l] = table[h * row_len + first_col + col_step * j] (high
 * pages fill a page-table row from the left, low pages from the right). Returns the page count,
 * or LK_BAD_PAGE / LK_OVERFLOW (a column outside the row, or more than `capacity` pages). */
int64_t lk_list_pages(const int32_t *restrict n_pages, int64_t heads, const int32_t *restrict table,
                      int64_t row_len, int64_t first_col, int64_t col_step, int64_t capacity,
                      int64_t *restrict head, int64_t *restrict rank, int64_t *restrict page_id) {
    int64_t n = 0;
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t count = n_pages[h];
        if (count < 0 || count > row_len) return LK_BAD_PAGE;
        if (count > capacity - n) return LK_OVERFLOW;
        for (int64_t j = 0; j < count; ++j, ++n) {
            const int64_t col = first_col + col_step * j;
            if (col < 0 || col >= row_len) return LK_BAD_PAGE;
            head[n] = h;
            rank[n] = j;
            page_id[n] = table[h * row_len + col];
        }
    }
    return n;
}

/* Pass 1. Pages: page l is pool + page_id[l] * page_bytes, rank rank[l] of head head[l] (grouped
 * by head); its segments start at the given byte offsets (codes nb = dim * bits / 8 bytes per
 * token, meta 2 * groups fp16 per token, positions int32, scores fp16). q: [BH, R, F] scaled
 * queries; q_pos: [BH, R] int32 position of each row's query; lens: [BH] int32 tokens the tier
 * holds per head. Writes out: [L, R, T] scores (-inf where not visible) and raises m: [BH, R] to
 * each row's maximum. pos_out ([L, T] int32, INT32_MAX on dead slots), valid_out ([L, T] 0/1) and
 * score_out ([L, T] fp32 stored significance) are written when not NULL. Returns 0 or an error. */
int lk_live_scores(const uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages,
                   const int64_t *restrict page_id, const int64_t *restrict head, const int64_t *restrict rank,
                   int64_t n_pages, int tokens, int dim, int rows, int bits, int group_size, int64_t data_off,
                   int64_t meta_off, int64_t pos_off, int64_t score_off, const float *restrict q,
                   const int32_t *restrict q_pos, const int32_t *restrict lens, float *restrict out,
                   float *restrict m, int32_t *restrict pos_out, uint8_t *restrict valid_out,
                   float *restrict score_out, int threads) {
    const int groups = dim / group_size, nb = dim * bits / 8;
    const int bad = check_pages(page_id, head, n_pages, pool_pages);
    if (bad) return bad;
    /* Scratch per thread: one token's codes, its scale and min, and sum(q_rg) of one head's rows.
     * On the stack when it fits (measured ~5% faster than the heap), else allocated, so no
     * head_dim, rows or groups limit. */
    const size_t need = (size_t)dim + 2 * (size_t)groups + (size_t)rows * groups;
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float stack[STACK_FLOATS];
        float *restrict codes = need <= STACK_FLOATS ? stack : malloc(sizeof(float) * need);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        failed = codes == NULL;
        float *restrict meta = failed ? NULL : codes + dim;
        float *restrict qsum = failed ? NULL : meta + 2 * groups;
        int64_t prev = -1;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            const int64_t h = head[l];
            const float *qh = q + h * rows * dim;
            const int32_t *qp = q_pos + h * rows;
            float *mh = m + h * rows;
            if (h != prev) { /* sum(q_rg) of this head's rows, once per head */
                prev = h;
                for (int r = 0; r < rows; ++r)
                    for (int g = 0; g < groups; ++g) {
                        float s = 0.0f;
                        for (int c = 0; c < group_size; ++c) s += qh[r * dim + g * group_size + c];
                        qsum[r * groups + g] = s;
                    }
            }
            const uint8_t *page = pool + page_id[l] * page_bytes;
            const int64_t left = (int64_t)lens[h] - rank[l] * tokens; /* stored tokens in this page */
            float *ol = out + l * rows * tokens;
            for (int t = 0; t < tokens; ++t) {
                const int live = t < left;
                int32_t pos = INT32_MAX;
                if (live) memcpy(&pos, page + pos_off + 4 * (int64_t)t, sizeof pos);
                if (pos_out) pos_out[l * tokens + t] = pos;
                if (valid_out) valid_out[l * tokens + t] = (uint8_t)live;
                if (score_out) {
                    uint16_t sh;
                    memcpy(&sh, page + score_off + 2 * (int64_t)t, sizeof sh);
                    score_out[l * tokens + t] = half_to_float(sh);
                }
                int seen = 0; /* rows whose query sees this slot */
                for (int r = 0; r < rows; ++r) seen += pos <= qp[r];
                if (!live || !seen) {
                    for (int r = 0; r < rows; ++r) ol[r * tokens + t] = -INFINITY;
                    continue;
                }
                unpack_token(page + data_off + (int64_t)t * nb, nb, bits, codes);
                load_meta(page + meta_off + (int64_t)t * 4 * groups, groups, meta);
                for (int r = 0; r < rows; ++r) {
                    float s = -INFINITY;
                    if (pos <= qp[r]) {
                        s = 0.0f;
                        for (int g = 0; g < groups; ++g)
                            s += meta[2 * g] * dot(qh + r * dim + g * group_size, codes + g * group_size, group_size)
                                 + meta[2 * g + 1] * qsum[r * groups + g];
                        if (s > mh[r]) mh[r] = s;
                    }
                    ol[r * tokens + t] = s;
                }
            }
        }
        if (codes != stack) free(codes);
    }
    return failed ? LK_NO_MEMORY : 0;
}

/* Pass 2. Pages as in pass 1, codes and meta of the value side. p: [L, R, T], in: pass 1's
 * scores; out: the softmax numerators exp(score - shift[head, r]) (0 where not visible). shift:
 * [BH, R] each row's maximum over all tiers (0 for a row that sees nothing). Adds each row's
 * numerators into l_sum: [BH, R] and their weighted values into acc: [BH, R, F] (unnormalized).
 * Returns 0 or an error. */
int lk_live_values(const uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages,
                   const int64_t *restrict page_id, const int64_t *restrict head, int64_t n_pages, int tokens,
                   int dim, int rows, int bits, int group_size, int64_t data_off, int64_t meta_off,
                   float *restrict p, const float *restrict shift, float *restrict l_sum, float *restrict acc,
                   int threads) {
    const int groups = dim / group_size, nb = dim * bits / 8;
    const int bad = check_pages(page_id, head, n_pages, pool_pages);
    if (bad) return bad;
    const size_t need = (size_t)dim + 2 * (size_t)groups;
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float stack[STACK_FLOATS];
        float *restrict codes = need <= STACK_FLOATS ? stack : malloc(sizeof(float) * need);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        failed = codes == NULL;
        float *restrict meta = failed ? NULL : codes + dim;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            const int64_t h = head[l];
            float *pl = p + l * rows * tokens;
            /* The page's numerators first, a row at a time: one branch-free loop that vectorizes. */
            for (int r = 0; r < rows; ++r) {
                const float sh = shift[h * rows + r];
                float *pr = pl + r * tokens, total = 0.0f;
                for (int t = 0; t < tokens; ++t) {
                    pr[t] = exp_numerator(pr[t] - sh);
                    total += pr[t];
                }
                l_sum[h * rows + r] += total;
            }
            const uint8_t *page = pool + page_id[l] * page_bytes;
            float *ah = acc + h * rows * dim;
            for (int t = 0; t < tokens; ++t) {
                int any = 0;
                for (int r = 0; r < rows; ++r) any |= pl[r * tokens + t] != 0.0f;
                if (!any) continue; /* dead, after every query, or underflowed: adds nothing */
                unpack_token(page + data_off + (int64_t)t * nb, nb, bits, codes);
                load_meta(page + meta_off + (int64_t)t * 4 * groups, groups, meta);
                for (int r = 0; r < rows; ++r) {
                    const float pr = pl[r * tokens + t];
                    if (pr == 0.0f) continue;
                    float *ar = ah + r * dim;
                    for (int g = 0; g < groups; ++g) {
                        const float w = pr * meta[2 * g], b = pr * meta[2 * g + 1];
                        float *ag = ar + g * group_size;
                        const float *cg = codes + g * group_size;
                        for (int c = 0; c < group_size; ++c) ag[c] += w * cg[c] + b;
                    }
                }
            }
        }
        if (codes != stack) free(codes);
    }
    return failed ? LK_NO_MEMORY : 0;
}

/* LeanKV's running significance of live slots after a decode step (Sec. 4; leankit.policy.
 * update_significance, term for term), written in place into the pages' fp16 score segments.
 * Per slot: received = sum_r p[l, r, t] * row_weight[h, r] (the probability mass the slot got,
 * averaged over the query heads of its group: row_weight = exp(shift - lse) / group, 0 for rows
 * that do not count); with n = max(q_last - pos + 1, 1) and m = n - max(q_first - pos, 0),
 *   s <- s + (received - s * m) / n.
 * Slots that hold no token, or whose sequence had no real query this step, keep their bytes.
 * pos, valid and stored: [L, T] as pass 1 wrote them; q_first, q_last and has: per sequence,
 * the sequence of head h being h / heads_per_seq. Returns 0 or an error. */
int lk_update_scores(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int64_t *restrict page_id,
                     const int64_t *restrict head, int64_t n_pages, int tokens, int rows, int64_t score_off,
                     int64_t heads_per_seq, const float *restrict p, const float *restrict row_weight,
                     const int32_t *restrict pos, const uint8_t *restrict valid, const float *restrict stored,
                     const int64_t *restrict q_first, const int64_t *restrict q_last, const uint8_t *restrict has,
                     int threads) {
    const int bad = check_pages(page_id, head, n_pages, pool_pages);
    if (bad) return bad;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads)
    {
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        for (int64_t l = l0; l < l1; ++l) {
            const int64_t h = head[l], seq = h / heads_per_seq;
            if (!has[seq]) continue;
            const float first = (float)q_first[seq], last = (float)q_last[seq];
            const float *w = row_weight + h * rows, *pl = p + l * rows * tokens;
            uint8_t *seg = pool + page_id[l] * page_bytes + score_off;
            for (int t = 0; t < tokens; ++t) {
                const int64_t i = l * tokens + t;
                if (!valid[i]) continue;
                float received = 0.0f;
                for (int r = 0; r < rows; ++r) received += pl[r * tokens + t] * w[r];
                const float ps = (float)pos[i], s = stored[i];
                float n = last - ps + 1.0f, before = first - ps;
                n = n < 1.0f ? 1.0f : n;
                const float m = n - (before < 0.0f ? 0.0f : before);
                const uint16_t out = float_to_half(s + (received - s * m) / n);
                memcpy(seg + 2 * (int64_t)t, &out, sizeof out);
            }
        }
    }
    return 0;
}

/* 1 if this build splits its loops over threads (built with OpenMP), else 0. */
int lk_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
