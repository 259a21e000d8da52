/* leankit's compiled CPU kernels for decode attention over live pages.
 *
 * The torch path (leankit/decode_attention.py) must convert every code to fp32 in memory before a
 * matmul can read it (4x the bytes the page holds) and multiplies one small page at a time. These
 * two loops read each page's codes once, unpack a token's codes into registers and use them at
 * once. Their contract is the torch path's, term for term (LeanKV Eq. 2, factored):
 *
 *   score(r, t) = sum_g s_g(t) (q_rg . Q_g(t)) + m_g(t) sum(q_rg)          (key side)
 *   acc(h, r, :) += sum_t p(r, t) (s_g(t) Q_g(t) + m_g(t))                  (value side)
 *
 * Q are the integer codes of one token, natural column order (code i of byte j is column
 * j * (8 / bits) + i, as leankit.quant.pack lays them out); s and m are the group's scale and min
 * (fp32 here, converted from the page's fp16 by the caller).
 *
 * Plain C99 with no dependencies, compiled on first use by leankit/native/__init__.py. Where torch
 * runs on GNU OpenMP, it is built with -fopenmp and binds to the libgomp torch has already loaded,
 * so its threads are torch's intra-op threads: one pool, no second set of spinning workers. The
 * key side splits its pages evenly; the value side splits only between heads (a head's pages are
 * summed by one thread, in page order), so every result is the same for any thread count.
 */
#include <stdint.h>
#include <stdlib.h>
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

/* Threads worth using on n_pages, at most `threads`. */
static int team_size(int64_t n_pages, int threads) {
    const int64_t most = n_pages / MIN_PAGES_PER_THREAD;
    if (threads > most) threads = (int)most;
    return threads < 1 ? 1 : threads;
}

/* First page of thread `tid`'s run out of `nth` over n_pages: an even share; with `by_head`,
 * moved forward to the first page of a head, so that no head spans two runs (head sorted). */
static int64_t run_start(const int64_t *head, int64_t n_pages, int tid, int nth, int by_head) {
    int64_t l = n_pages * tid / nth;
    if (by_head)
        while (l > 0 && l < n_pages && head[l] == head[l - 1]) ++l;
    return l;
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

/* Key side. q: [BH, R, F] scaled queries; head: [L] the (sequence, KV head) of each live page;
 * codes of page l, token t at data + l * page_stride + t * nb; meta: [L, T, G, 2] (scale, min);
 * out: [L, R, T] scores. Returns 0, or -1 if its scratch could not be allocated. */
int lk_key_scores(const float *restrict q, const int64_t *restrict head, const uint8_t *restrict data,
                  int64_t page_stride, int64_t n_pages, int tokens, int dim, int rows, int bits,
                  int group_size, const float *restrict meta, float *restrict out, int threads) {
    const int groups = dim / group_size, nb = dim * bits / 8;
    /* Scratch per thread: one token's codes and sum(q_rg) of one head's rows. On the stack when
     * it fits (measured ~5% faster than the heap), else allocated, so no head_dim, rows or
     * groups limit. */
    const size_t need = (size_t)dim + (size_t)rows * groups;
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float stack[STACK_FLOATS];
        float *restrict codes = need <= STACK_FLOATS ? stack : malloc(sizeof(float) * need);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth, 0), l1 = run_start(head, n_pages, tid + 1, nth, 0);
        failed = codes == NULL;
        float *restrict qsum = failed ? NULL : codes + dim;
        int64_t prev = -1;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            const float *qh = q + head[l] * rows * dim;
            if (head[l] != prev) { /* sum(q_rg) of this head's rows, once per head */
                prev = head[l];
                for (int r = 0; r < rows; ++r)
                    for (int g = 0; g < groups; ++g) {
                        float s = 0.0f;
                        for (int c = 0; c < group_size; ++c) s += qh[r * dim + g * group_size + c];
                        qsum[r * groups + g] = s;
                    }
            }
            const uint8_t *page = data + l * page_stride;
            for (int t = 0; t < tokens; ++t) {
                unpack_token(page + t * nb, nb, bits, codes);
                const float *mt = meta + ((l * tokens) + t) * groups * 2;
                for (int r = 0; r < rows; ++r) {
                    float s = 0.0f;
                    for (int g = 0; g < groups; ++g)
                        s += mt[2 * g] * dot(qh + r * dim + g * group_size, codes + g * group_size, group_size)
                             + mt[2 * g + 1] * qsum[r * groups + g];
                    out[(l * rows + r) * tokens + t] = s;
                }
            }
        }
        if (codes != stack) free(codes);
    }
    return failed ? -1 : 0;
}

/* Value side. p: [L, R, T] softmax numerators (0 where dead or masked); codes and meta as above
 * (dead slots hold scale and min 0); acc: [BH, R, F], added to. Returns 0, or -1 as above. */
int lk_value_accumulate(const float *restrict p, const int64_t *restrict head, const uint8_t *restrict data,
                        int64_t page_stride, int64_t n_pages, int tokens, int dim, int rows, int bits,
                        int group_size, const float *restrict meta, float *restrict acc, int threads) {
    const int groups = dim / group_size, nb = dim * bits / 8;
    /* Runs end between heads, so two threads never add into one accumulator. That needs the
     * pages sorted by head (leankit gathers them so); an unsorted index runs on one thread. */
    int sorted = 1;
    for (int64_t l = 1; l < n_pages && sorted; ++l) sorted = head[l] >= head[l - 1];
    int failed = 0;
    threads = sorted ? team_size(n_pages, threads) : 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float stack[STACK_FLOATS];
        float *restrict codes = (size_t)dim <= STACK_FLOATS ? stack : malloc(sizeof(float) * (size_t)dim);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth, 1), l1 = run_start(head, n_pages, tid + 1, nth, 1);
        failed = codes == NULL;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            float *ah = acc + head[l] * rows * dim;
            const uint8_t *page = data + l * page_stride;
            for (int t = 0; t < tokens; ++t) {
                unpack_token(page + t * nb, nb, bits, codes);
                const float *mt = meta + ((l * tokens) + t) * groups * 2;
                for (int r = 0; r < rows; ++r) {
                    const float pr = p[(l * rows + r) * tokens + t];
                    if (pr == 0.0f) continue; /* dead slot or after the query: adds nothing */
                    float *ar = ah + r * dim;
                    for (int g = 0; g < groups; ++g) {
                        const float w = pr * mt[2 * g], b = pr * mt[2 * g + 1];
                        float *ag = ar + g * group_size;
                        const float *cg = codes + g * group_size;
                        for (int c = 0; c < group_size; ++c) ag[c] += w * cg[c] + b;
                    }
                }
            }
        }
        if (codes != stack) free(codes);
    }
    return failed ? -1 : 0;
}

/* 1 if this build splits its loops over threads (built with OpenMP), else 0. */
int lk_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
