/* leankit's compiled CPU kernels for decode attention over live pages.
 *
 * The torch path (leankit/decode_attention.py) gathers every live page into a copy, converts every
 * code and every fp16 scale to fp32 in memory before a matmul can read them (4x the bytes the page
 * holds), multiplies one small page at a time, and runs the masks, the softmax and the per-head
 * reductions as a dozen separate tensor ops per tier. These kernels read each page in place in the
 * pool, through its id, once per pass, dequantize a token into a small scratch row and use it at
 * once:
 *
 *   lk_list_pages   the live pages of one tier: (head, rank, pool id) per page, from the page table;
 *   lk_live_scores  pass 1: masked scaled scores of every live slot and the per-head row maxima;
 *   lk_live_values  pass 2: softmax numerators, their per-head sums and the values' weighted sum;
 *   lk_update_scores  the running significance of the live slots, written back into their pages.
 *
 * Their contract is the torch path's (LeanKV Eq. 2, x = s Q + m per group):
 *
 *   score(r, t) = q_r . x_k(t)                      if slot t is visible to row r, else -inf
 *   p(r, t)     = exp(score(r, t) - shift(r))
 *   acc(h, r, :) += sum_t p(r, t) x_v(t)
 *
 * x(t) is one token's key or value dequantized from its integer codes Q and its groups' fp16 scale
 * s and min m, or, on a dense side (formats.h: the FP16 config, or a K16/V16 side), the stored
 * fp32, fp16 or bf16 value itself. A slot is visible when it holds a stored token (slot index < the tier's length
 * minus the slots of the head's earlier pages) whose position is not after the row's query. Dead
 * slots are never read beyond their position, so stale bytes (NaN patterns included) in them
 * cannot reach any result.
 *
 * Where the time goes, and what each piece here is for (SmolLM2-135M, K8V4 + K4V2 tiers, 1k
 * context, one thread; see leankit/bench): pages lie anywhere in the pool, so each pass prefetches
 * the next page's segments while it computes this one (the misses were about half the time);
 * codes unpack into plane order (below) so every unpack loop vectorizes; pass 1 dequantizes a block
 * of keys before it dots the query rows with them (score_page), and pass 2, from two query rows on,
 * a block of values before the rows add them (value_page_rows); and the common geometries get
 * copies of the page loops with head_dim, bits and group size fixed at compile time. Where the
 * build targets AVX-512 or AVX2, a few loops the compiler left slow are written in vector
 * intrinsics, each beside the plain C it replaces on other CPUs: the key block's dot products
 * (block_dot), the masks and row maxima (mask_row) and the code unpack (dequantize_token). In a real
 * decode step a layer's pages come from DRAM, where both passes run 2-4x slower than on pages in
 * cache (bench/native_passes.py, --cold against the default).
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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h> /* the vector paths below; every one has a plain C twin */
#endif
/* One float vector of the vector paths: 16 lanes on AVX-512, 8 on AVX2 (with FMA). */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 lanes_f;
typedef __m512i lanes_i;
#define lanes_set1_ps _mm512_set1_ps
#define lanes_set1_epi32 _mm512_set1_epi32
#define lanes_widen_bytes(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define lanes_and _mm512_and_si512
#define lanes_srli(x, n) _mm512_srli_epi32((x), (unsigned)(n))
#define lanes_cvt_ps _mm512_cvtepi32_ps
#define lanes_fmadd_ps _mm512_fmadd_ps
#define lanes_mul_ps _mm512_mul_ps
#define lanes_loadu_ps _mm512_loadu_ps
#define lanes_storeu_ps _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 lanes_f;
typedef __m256i lanes_i;
#define lanes_set1_ps _mm256_set1_ps
#define lanes_set1_epi32 _mm256_set1_epi32
#define lanes_widen_bytes(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define lanes_and _mm256_and_si256
#define lanes_srli(x, n) _mm256_srli_epi32((x), (int)(n))
#define lanes_cvt_ps _mm256_cvtepi32_ps
#define lanes_fmadd_ps _mm256_fmadd_ps
#define lanes_mul_ps _mm256_mul_ps
#define lanes_loadu_ps _mm256_loadu_ps
#define lanes_storeu_ps _mm256_storeu_ps
#endif

#include "errors.h"
#include "kernels.h"
#include "fp16.h"
#include "formats.h"
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#define THREAD_COUNT omp_get_num_threads()
#else
#define THREAD_ID 0
#define THREAD_COUNT 1
#endif

#define STACK_FLOATS 4096 /* scratch kept on the stack up to this size */
#define TOKEN_BLOCK 16 /* keys pass 1 dequantizes before it multiplies: 4 KB of fp32 at head_dim 64 */
#define MIN_PAGES_PER_THREAD 8 /* fewer pages cost more to hand to a thread than they save */


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

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The fp16 at src (any alignment), as float. */
ALWAYS_INLINE float half_at(const uint8_t *src) {
    uint16_t h;
    memcpy(&h, src, sizeof h);
    return half_to_float(h);
}

/* exp_numerator's constants, shared with its 8-lane twin: log2(e), ln 2 split in two (Cody-Waite),
 * and Cephes' degree-5 minimax coefficients of e^r, highest first. */
#define EXP_LOWEST (-87.0f) /* e^x < 2^-125 below it: a numerator of 0 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f

/* e^x for the softmax numerators (x <= 0 there), branch-free so a page's numerators vectorize:
 * e^x = 2^n e^r with n = round(x / ln 2) and ln 2 split in two (Cody-Waite), e^r from Cephes'
 * degree-5 minimax polynomial; within a few ulp of expf where FMA is available. 0 below -87
 * (e^x < 2^-125), -inf included. */
static inline float exp_numerator(float x) {
    const float lowest = EXP_LOWEST;
    const float xc = x < lowest ? lowest : x;
    const float n = floorf(xc * EXP_LOG2E + 0.5f);
#ifdef __FMA__ /* fused: the compiler's reassociation cannot merge the two halves of ln 2 */
    float r = fmaf(n, -EXP_LN2_HI, xc);
    r = fmaf(n, EXP_LN2_LO, r);
#else /* may be merged into one multiply by fp32 ln 2: error then grows to about |x| * 4e-8 relative */
    float r = xc - n * EXP_LN2_HI;
    r = r + n * EXP_LN2_LO;
#endif
    float poly = EXP_P5;
#ifdef __FMA__
    /* Horner's steps fused (-std=c99 keeps the compiler from contracting them): a shorter chain,
     * pass 2 in 0.96-0.98x the time. The last step stays unfused: fused too, the largest error
     * over [-87, 0] grew from 0.98 to 1.24 ulp; as here it is 0.97. */
    poly = fmaf(poly, r, EXP_P4);
    poly = fmaf(poly, r, EXP_P3);
    poly = fmaf(poly, r, EXP_P2);
    poly = fmaf(poly, r, EXP_P1);
    poly = fmaf(poly, r, EXP_P0);
#else
    poly = poly * r + EXP_P4;
    poly = poly * r + EXP_P3;
    poly = poly * r + EXP_P2;
    poly = poly * r + EXP_P1;
    poly = poly * r + EXP_P0;
#endif
    const float er = poly * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < lowest ? 0.0f : er * two_n;
}

#if defined(LANES) && LANES == 8
/* exp_numerator on 8 lanes, the same operations in the same order. */
ALWAYS_INLINE __m256 exp_numerators8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(EXP_LOWEST);
    const __m256 xc = _mm256_max_ps(lowest, x); /* x itself when NaN, as x < lowest ? lowest : x */
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                                   _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 poly = _mm256_set1_ps(EXP_P5);
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(EXP_P4));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(EXP_P3));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(EXP_P2));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(EXP_P1));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(EXP_P0));
    const __m256 er = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(poly, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 below = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    return _mm256_andnot_ps(below, _mm256_mul_ps(er, _mm256_castsi256_ps(bits)));
}
#endif

/* Bytes of one token's metadata on a side (an fp16 scale and min per group; none for a dense side). */
ALWAYS_INLINE int meta_bytes(int dim, int bits, int group_size) { return bits <= 8 ? 4 * (dim / group_size) : 0; }

/* Codes in plane order: within each group, the codes of bit slot i of every byte come before
 * those of slot i + 1 (column j * P + i of the group, P = 8 / bits codes per byte, sits at
 * i * (group_size / P) + j). Unpacking into this order is a shift and a mask over consecutive
 * bytes, which vectorizes whole; the natural order would interleave the slots of each byte. The
 * queries are put into the same order once per head (a dot product does not care about the
 * order), and value sums are kept in it and put back once per head.
 *
 * to_planes: rows x dim floats from natural column order into plane order. */
ALWAYS_INLINE void to_planes(const float *restrict src, float *restrict dst, int rows, int dim, int bits, int group_size) {
    if (bits > 8) { /* a dense side keeps the natural order */
        memcpy(dst, src, sizeof(float) * (size_t)rows * dim);
        return;
    }
    const int per_byte = 8 / bits, group_bytes = group_size / per_byte;
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < dim; g += group_size)
            for (int i = 0; i < per_byte; ++i)
                for (int j = 0; j < group_bytes; ++j)
                    dst[r * dim + g + i * group_bytes + j] = src[r * dim + g + j * per_byte + i];
}

/* dst (natural order) += src (plane order), rows x dim; src is cleared for the next head. */
ALWAYS_INLINE void add_from_planes(float *restrict src, float *restrict dst, int rows, int dim, int bits, int group_size) {
    if (bits > 8) {
        for (int64_t i = 0; i < (int64_t)rows * dim; ++i) dst[i] += src[i];
        memset(src, 0, sizeof(float) * (size_t)rows * dim);
        return;
    }
    const int per_byte = 8 / bits, group_bytes = group_size / per_byte;
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < dim; g += group_size)
            for (int i = 0; i < per_byte; ++i)
                for (int j = 0; j < group_bytes; ++j)
                    dst[r * dim + g + j * per_byte + i] += src[r * dim + g + i * group_bytes + j];
    memset(src, 0, sizeof(float) * (size_t)rows * dim);
}

/* One token of one side, dequantized (LeanKV Eq. 2: x = s Q + m, s and m its group's fp16 scale
 * and min) into out[dim] in plane order: codes dim * bits / 8 bytes, meta (s, m) fp16 pairs per
 * group. Inlined with constant dim, bits and group_size in the specialized page loops, where each
 * plane is one fixed-length loop over consecutive bytes that compiles to straight vector code. */
ALWAYS_INLINE void dequantize_token(const uint8_t *restrict codes, const uint8_t *restrict meta, int dim, int bits,
                                    int group_size, float *restrict out) {
    if (bits > 8) { /* a dense side: the model's values as they are, widened to float */
        if (bits == LK_DENSE_F32) {
            memcpy(out, codes, sizeof(float) * (size_t)dim);
        } else if (bits == LK_DENSE_F16) {
            for (int c = 0; c < dim; ++c) out[c] = half_at(codes + 2 * c);
        } else { /* bf16: the high half of a float */
            for (int c = 0; c < dim; ++c) {
                uint16_t h;
                memcpy(&h, codes + 2 * c, sizeof h);
                const uint32_t w = (uint32_t)h << 16;
                memcpy(out + c, &w, sizeof w);
            }
        }
        return;
    }
    const int per_byte = 8 / bits, group_bytes = group_size / per_byte, mask = (1 << bits) - 1;
#ifdef LANES
    /* The same planes in vectors of LANES codes, one code byte widened per lane: inlined into
     * the page loops, the plain loops below compiled to half-width vectors with extra widening
     * steps (8-bit codes) or a plane loop that was not unrolled (4-bit). On AVX-512, groups of 8
     * code bytes (2-bit codes in groups of 32) keep the plain loops, which measured faster there
     * than a half-width version. */
    if (group_bytes % LANES == 0) {
        const lanes_i vmask = lanes_set1_epi32(mask);
        for (int g = 0; g < dim / group_size; ++g) {
            const lanes_f vs = lanes_set1_ps(half_at(meta + 4 * g)), vm = lanes_set1_ps(half_at(meta + 4 * g + 2));
            const uint8_t *restrict src = codes + g * group_bytes;
            float *restrict o = out + g * group_size;
            for (int j = 0; j < group_bytes; j += LANES) {
                const lanes_i bytes = lanes_widen_bytes(src + j);
                for (int i = 0; i < per_byte; ++i) {
                    const lanes_i q = lanes_and(lanes_srli(bytes, i * bits), vmask);
                    lanes_storeu_ps(o + i * group_bytes + j, lanes_fmadd_ps(vs, lanes_cvt_ps(q), vm));
                }
            }
        }
        return;
    }
#endif
    for (int g = 0; g < dim / group_size; ++g) {
        const float s = half_at(meta + 4 * g), m = half_at(meta + 4 * g + 2);
        const uint8_t *restrict src = codes + g * group_bytes;
        for (int i = 0; i < per_byte; ++i) {
            float *restrict o = out + g * group_size + i * group_bytes;
            for (int j = 0; j < group_bytes; ++j) o[j] = fmaf(s, (float)((src[j] >> (i * bits)) & mask), m);
        }
    }
}

ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
    for (int c = 0; c < n; ++c) s += a[c] * b[c];
    return s;
}

#ifdef LANES
/* acc[t] = the lane-wise products of q and keys[t], summed over head_dim's vectors, for LANES keys:
 * what one shuffle tree then sums across its lanes. */
ALWAYS_INLINE void lane_products(const float *restrict q, const float *restrict keys, int D, lanes_f *restrict acc) {
    const lanes_f q0 = lanes_loadu_ps(q);
    for (int t = 0; t < LANES; ++t) acc[t] = lanes_mul_ps(q0, lanes_loadu_ps(keys + t * D));
    for (int c = LANES; c < D; c += LANES) {
        const lanes_f qc = lanes_loadu_ps(q + c);
        for (int t = 0; t < LANES; ++t) acc[t] = lanes_fmadd_ps(qc, lanes_loadu_ps(keys + t * D + c), acc[t]);
    }
}
#endif
#ifdef __AVX2__
/* All ones in lanes 0..n-1 and zero past them (none when n <= 0): the mask of a partial vector's
 * live lanes, for masked loads and blends. */
ALWAYS_INLINE __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* out[0..n) = the first n < 8 lanes of v, nothing past them, in 4-, 2- and 1-lane pieces. GCC
 * compiles a copy loop of n floats to a `rep movs`, and AVX2's masked store (VMASKMOVPS) is
 * microcoded on AMD Zen; in mask_row this took pass 1 over pages with a partial last vector of
 * slots (17 and 28 slots) to 0.93-0.96x of the copy loop's time. */
ALWAYS_INLINE void store_first(float *restrict out, __m256 v, int n) {
    __m128 rest = _mm256_castps256_ps128(v);
    if (n >= 4) {
        _mm_storeu_ps(out, rest);
        rest = _mm256_extractf128_ps(v, 1);
        out += 4;
        n -= 4;
    }
    if (n >= 2) {
        _mm_storel_pi((__m64 *)out, rest);
        rest = _mm_movehl_ps(rest, rest);
        out += 2;
        n -= 2;
    }
    if (n) _mm_store_ss(out, rest);
}
#endif
/* tree_dot: out[t] = q . keys[t] for the n keys of a 16-key block, by transposing shuffle trees
 * (see block_dot). It reads all 16 rows of the block whatever n is (AVX2: 8 rows, 16 when n > 8). */
#if defined(__AVX512F__)
ALWAYS_INLINE __m512 unpack_pair_sum(__m512 a, __m512 b) { /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
ALWAYS_INLINE __m512 in_lane_sum(__m512 ab, __m512 cd) { /* per 128-bit lane: the four keys' partial sums */
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
ALWAYS_INLINE __m512 cross_lane_sum(__m512 a, __m512 b) { /* 128-bit lanes: a0+a1, a2+a3, b0+b1, b2+b3 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
ALWAYS_INLINE void tree_dot(const float *restrict q, const float *restrict keys, int n, int D, float *restrict out) {
    __m512 acc[16];
    lane_products(q, keys, D, acc);
    __m512 pair[8], quad[4];
    for (int i = 0; i < 8; ++i) pair[i] = unpack_pair_sum(acc[2 * i], acc[2 * i + 1]);
    for (int i = 0; i < 4; ++i) quad[i] = in_lane_sum(pair[2 * i], pair[2 * i + 1]);
    const __m512 sums = cross_lane_sum(cross_lane_sum(quad[0], quad[1]), cross_lane_sum(quad[2], quad[3]));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1u), sums);
}
#elif defined(LANES) /* AVX2 with FMA: two trees of 8 keys */
ALWAYS_INLINE void tree_dot8(const float *restrict q, const float *restrict keys, int n, int D, float *restrict out) {
    __m256 acc[8];
    lane_products(q, keys, D, acc);
    __m256 pair[4], quad[2];
    for (int i = 0; i < 4; ++i)
        pair[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        quad[i] = _mm256_add_ps(_mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20),
                                      _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
    /* Through a copy: storing a whole block's 8 sums straight into the row (a partial block's with
     * store_first) measured 1.12x slower pass 1 on AMD Zen (4-bit keys, 32-slot pages). */
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int t = 0; t < n; ++t) out[t] = lanes[t];
}
ALWAYS_INLINE void tree_dot(const float *restrict q, const float *restrict keys, int n, int D, float *restrict out) {
    tree_dot8(q, keys, n < 8 ? n : 8, D, out);
    if (n > 8) tree_dot8(q, keys + 8 * D, n - 8, D, out + 8);
}
#endif
#if defined(LANES) && TOKEN_BLOCK != 16
#error "tree_dot sums blocks of 16 keys: TOKEN_BLOCK must be 16"
#endif

/* out[t] = q . keys[t] for the n <= TOKEN_BLOCK keys of a block (rows of D floats).
 *
 * A dot product on its own ends in a horizontal sum of its vector accumulator: 8 shuffles and
 * adds per key and query row at 16 lanes, about as many instructions as its D / 16 FMAs at
 * head_dim 64. With vector instructions available, a block instead keeps one accumulator per key
 * and sums all of them at once in a transposing tree (unpack, then in-lane, then cross-lane
 * shuffles, each level halving the vectors), which leaves lane t holding key t's sum: 45 shuffles
 * and adds per 16 keys (21 per 8 with AVX2). Lanes past n read the block's later rows (in the
 * scratch block, earlier keys or the zeros it was allocated with; in a page read in place, its
 * next bytes) and are never stored: each lane sums its own key only. A tree for fewer
 * than LANES / 2 keys costs more than their own sums, so they keep those. */
ALWAYS_INLINE void block_dot(const float *restrict q, const float *restrict keys, int n, int D, float *restrict out) {
#ifdef LANES
    if (D % LANES == 0 && n >= LANES / 2) {
        tree_dot(q, keys, n, D, out);
        return;
    }
#endif
    for (int t = 0; t < n; ++t) out[t] = dot(q, keys + t * D, D);
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

/* Ask for `bytes` bytes at p ahead of their use: the next page's segments are fetched while this
 * page is computed (pages lie anywhere in the pool, so the hardware cannot guess the next one). */
static inline void prefetch_span(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* One tier's page geometry: tokens per page, head_dim, query rows per head, code width and group
 * size, the byte offsets of the segments a pass reads, and the page's size. */
struct tier_pages {
    int tokens, dim, rows, bits, group_size;
    int64_t data_off, meta_off, pos_off, score_off, page_bytes;
};

/* What a pass reads of a page: the codes and metadata of its side, and (when asked) the positions
 * and the stored scores. Forced inline: as a call it measured 40% slower passes. */
ALWAYS_INLINE void prefetch_page(const uint8_t *page, const struct tier_pages *tp, int positions, int scores) {
    prefetch_span(page + tp->data_off, (int64_t)tp->tokens * lk_row_bytes(tp->dim, tp->bits));
    prefetch_span(page + tp->meta_off, (int64_t)tp->tokens * meta_bytes(tp->dim, tp->bits, tp->group_size));
    if (positions) prefetch_span(page + tp->pos_off, (int64_t)tp->tokens * 4);
    if (scores) prefetch_span(page + tp->score_off, (int64_t)tp->tokens * 2);
}

/* The position of slot t of a page whose first `live` slots hold tokens (positions segment at
 * pos_seg), or INT32_MAX for a slot past them, whose bytes are never read. */
ALWAYS_INLINE int32_t slot_position(const uint8_t *restrict pos_seg, int t, int live) {
    int32_t pos = INT32_MAX;
    if (t < live) memcpy(&pos, pos_seg + 4 * (int64_t)t, sizeof pos);
    return pos;
}

/* One query row's scores over a page, masked: o[t] becomes -inf where slot t holds no token (t >=
 * live) or a token after the row's query position qr. Returns the larger of `most` and the row's
 * largest visible score (a NaN score never raises it). With AVX-512 or AVX2 a vector of slots is tested
 * and maximized at once, dead slots' positions masked off the load; the scalar loop's maximum is
 * one dependent compare per slot (about a sixth of pass 1 on 28-slot pages). */
ALWAYS_INLINE float mask_row(float *restrict o, const uint8_t *restrict pos_seg, int tokens, int live, int32_t qr,
                             float most) {
#if defined(__AVX512F__)
    const __m512 hidden = _mm512_set1_ps(-INFINITY);
    const __m512i query = _mm512_set1_epi32(qr);
    __m512 top = hidden;
    for (int t = 0; t < tokens; t += 16) {
        const int n = tokens - t < 16 ? tokens - t : 16, alive = live - t < n ? live - t : n;
        const __mmask16 slots = (__mmask16)((1u << n) - 1u);
        const __mmask16 held = alive <= 0 ? 0 : (__mmask16)((1u << alive) - 1u);
        const __m512i pos = _mm512_maskz_loadu_epi32(held, pos_seg + 4 * (int64_t)t);
        const __mmask16 seen = _mm512_mask_cmple_epi32_mask(held, pos, query);
        const __m512 s = _mm512_mask_loadu_ps(hidden, seen, o + t);
        _mm512_mask_storeu_ps(o + t, slots, s);
        top = _mm512_max_ps(s, top); /* MAXPS returns its second operand when the first is NaN */
    }
    const float row_top = _mm512_reduce_max_ps(top);
    return row_top > most ? row_top : most;
#elif defined(__AVX2__)
    const __m256 hidden = _mm256_set1_ps(-INFINITY);
    const __m256i query = _mm256_set1_epi32(qr);
    __m256 top = hidden;
    /* Whole vectors of 8 live slots take plain loads and stores, and only the rest is masked and
     * stored with store_first: AVX2's masked store (VMASKMOVPS) is microcoded on AMD Zen, where one
     * per 8 slots cost about 5% of pass 1. */
    int t = 0;
    for (; t + 8 <= live; t += 8) { /* live <= tokens */
        const __m256i pos = _mm256_loadu_si256((const __m256i *)(pos_seg + 4 * (int64_t)t));
        const __m256 after = _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, query)); /* the query cannot see it */
        const __m256 s = _mm256_blendv_ps(_mm256_loadu_ps(o + t), hidden, after);
        _mm256_storeu_ps(o + t, s);
        top = _mm256_max_ps(s, top); /* MAXPS returns its second operand when the first is NaN */
    }
    for (; t < tokens; t += 8) {
        const int n = tokens - t < 8 ? tokens - t : 8, alive = live - t < n ? live - t : n;
        const __m256i slots = first_lanes(n);
        const __m256i held = first_lanes(alive); /* none when alive <= 0 */
        const __m256i pos = _mm256_maskload_epi32((const int *)(pos_seg + 4 * (int64_t)t), held);
        const __m256 seen = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(pos, query), held));
        const __m256 s = _mm256_blendv_ps(hidden, _mm256_maskload_ps(o + t, slots), seen);
        if (n == 8)
            _mm256_storeu_ps(o + t, s);
        else
            store_first(o + t, s, n);
        top = _mm256_max_ps(s, top); /* MAXPS returns its second operand when the first is NaN */
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    const float row_top = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
    return row_top > most ? row_top : most;
#else
    for (int t = 0; t < tokens; ++t) {
        const float s = slot_position(pos_seg, t, live) <= qr ? o[t] : -INFINITY;
        o[t] = s;
        most = s > most ? s : most;
    }
    return most;
#endif
}

#ifdef LANES
/* Pass 1 for many query rows (a long step's chunk of queries times the group). block_dot's cost per
 * row and key is its share of the transposing tree and of the key loads, paid again by every row;
 * with many rows the block is instead transposed once (key_columns) and each row's scores come out
 * of plain FMAs: column c of the block is a vector of TOKEN_BLOCK keys' values, times q[c]
 * broadcast, summed over c. SCORE_ROWS rows at a time give that many independent sums, which
 * keeps the FMA units busy where one row's chain of head_dim dependent FMAs would wait on their
 * latency. The sums run over the columns in order, so a score differs from block_dot's tree sum by
 * fp32 rounding only. */
/* From this many rows the transpose, once per block, costs less than it saves (AVX-512, head_dim 64:
 * 16 rows 1.04x and 24 rows 1.01-1.03x block_dot's time, 32 rows 0.84-0.89x). */
#define SCORE_ROWS_MIN 32
#define KEY_VECTORS (TOKEN_BLOCK / LANES) /* vectors of one column of a block: 1 (AVX-512), 2 (AVX2) */
/* Rows at a time: 16 sums (AVX-512) or 6 x 2 (AVX2: 15 of its 16 registers with the column and a
 * broadcast; 4 x 2 measured 1.06-1.18x block_dot's time, 6 x 2 0.59-0.73x). The last rows of a
 * step, fewer than this, take block_dot. */
#define SCORE_ROWS (LANES == 16 ? 16 : 6)

/* key_t[c * TOKEN_BLOCK + t] = block[t * D + c] for the n keys of a block; lanes past n keep what
 * they held (zeros or earlier keys) and are never stored. */
ALWAYS_INLINE void key_columns(const float *restrict block, int n, int D, float *restrict key_t) {
    for (int t = 0; t < n; ++t)
        for (int c = 0; c < D; ++c) key_t[c * TOKEN_BLOCK + t] = block[t * D + c];
}

/* o[r * tokens + t] = q_r . key t for RB rows (q_r at qh + r * D) and the n keys of a transposed block. */
ALWAYS_INLINE void rows_key_dots(const float *restrict qh, int RB, const float *restrict key_t, int n, int D,
                                 float *restrict o, int tokens) {
    lanes_f acc[SCORE_ROWS][KEY_VECTORS];
    for (int r = 0; r < RB; ++r)
        for (int v = 0; v < KEY_VECTORS; ++v) acc[r][v] = lanes_set1_ps(0.0f);
    for (int c = 0; c < D; ++c) {
        lanes_f k[KEY_VECTORS];
        for (int v = 0; v < KEY_VECTORS; ++v) k[v] = lanes_loadu_ps(key_t + c * TOKEN_BLOCK + v * LANES);
        for (int r = 0; r < RB; ++r) {
            const lanes_f q = lanes_set1_ps(qh[r * D + c]);
            for (int v = 0; v < KEY_VECTORS; ++v) acc[r][v] = lanes_fmadd_ps(q, k[v], acc[r][v]);
        }
    }
    for (int r = 0; r < RB; ++r) {
#if LANES == 16
        _mm512_mask_storeu_ps(o + (size_t)r * tokens, (__mmask16)((1u << n) - 1u), acc[r][0]);
#else
        for (int v = 0; v < KEY_VECTORS; ++v) {
            const int m = n - v * LANES;
            if (m >= LANES)
                _mm256_storeu_ps(o + (size_t)r * tokens + v * LANES, acc[r][v]);
            else if (m > 0)
                store_first(o + (size_t)r * tokens + v * LANES, acc[r][v], m);
        }
#endif
    }
}
#endif

/* Pass 1 over one page (l) of head h: see lk_live_scores. D, B and G are the tier's head_dim, code
 * width and group size, passed as constants by the specialized copies below.
 *
 * A block of up to TOKEN_BLOCK live tokens is dequantized first, then each query row is dotted
 * with the whole block, then the masks and maxima run over the page. Per token and row, a dot is
 * then straight vector code over D with nothing else in the loop: interleaving the dequantization,
 * a visibility test per row (a loop over a run-time row count) and the dot, token by token, kept
 * the compiler to scalar bookkeeping between short vector bursts (measured 1.5-2x slower). Slots
 * at or past `left` hold no token and are never read; a live slot no row sees is still dotted
 * (its codes are finite) and masked afterwards, which costs less than testing it. */
ALWAYS_INLINE void score_page(const struct tier_pages *restrict tp, int D, int B, int G, const uint8_t *restrict page,
                              int64_t left, const float *restrict qh, const int32_t *restrict qp,
                              float *restrict mh, float *restrict ol, int32_t *restrict pos_l,
                              uint8_t *restrict valid_l, float *restrict score_l, float *restrict keys) {
    const int tokens = tp->tokens, rows = tp->rows, nb = lk_row_bytes(D, B), mb = meta_bytes(D, B, G);
    const int live = left <= 0 ? 0 : (left < tokens ? (int)left : tokens);
    const uint8_t *restrict pos_seg = page + tp->pos_off;
    if (pos_l)
        for (int t = 0; t < tokens; ++t) pos_l[t] = slot_position(pos_seg, t, live);
    if (valid_l)
        for (int t = 0; t < tokens; ++t) valid_l[t] = (uint8_t)(t < live);
    if (score_l)
        for (int t = 0; t < tokens; ++t) score_l[t] = half_at(page + tp->score_off + 2 * (int64_t)t);
    for (int t0 = 0; t0 < live; t0 += TOKEN_BLOCK) {
        const int n = live - t0 < TOKEN_BLOCK ? live - t0 : TOKEN_BLOCK;
        const float *restrict block = keys;
        if (B == LK_DENSE_F32 && tp->data_off + (int64_t)(t0 + TOKEN_BLOCK) * nb <= tp->page_bytes)
            /* fp32 keys are already the block's rows: read in place, not copied (the copy was about
             * a third of pass 1 on such pages). Whatever a whole block's rows past n hold (the next
             * slots' or segment's bytes, inside the page) only reaches lanes that are never stored. */
            block = (const float *)(page + tp->data_off + (int64_t)t0 * nb);
        else
            for (int t = 0; t < n; ++t)
                dequantize_token(page + tp->data_off + (int64_t)(t0 + t) * nb,
                                 page + tp->meta_off + (int64_t)(t0 + t) * mb, D, B, G, keys + t * D);
#ifdef LANES
        if (rows >= SCORE_ROWS_MIN && n >= LANES / 2) { /* a few keys keep their own dots, as in block_dot */
            float *restrict key_t = keys + (size_t)D * TOKEN_BLOCK; /* after the block (lk_live_scores) */
            key_columns(block, n, D, key_t);
            int r = 0;
            for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS)
                rows_key_dots(qh + (size_t)r * D, SCORE_ROWS, key_t, n, D, ol + (size_t)r * tokens + t0, tokens);
            for (; r < rows; ++r) /* the last rows (fewer than SCORE_ROWS: too few sums for the FMA units) */
                block_dot(qh + (size_t)r * D, block, n, D, ol + (size_t)r * tokens + t0);
            continue;
        }
#endif
        for (int r = 0; r < rows; ++r) {
            const float *restrict q = qh + r * D;
            float *restrict o = ol + r * tokens + t0;
            block_dot(q, block, n, D, o);
        }
    }
    for (int r = 0; r < rows; ++r) mh[r] = mask_row(ol + r * tokens, pos_seg, tokens, live, qp[r], mh[r]);
}

#if defined(LANES) && LANES == 8
/* Pass 2 with value sums held in registers (value_page_held), for AVX2 builds: HELD_SUMS of the
 * 16 vector registers hold sums, the codes, scales and probabilities being worked on the rest.
 * Measured against the plain loop (bench/native_passes.py --against, an AMD EPYC with AVX2, head_dim
 * 64, 3 query rows): 0.80x for 2-bit values, 1.00-1.04x for 4-bit, 1.09x for 8-bit, so only 2-bit
 * values take it (1-bit codes have no specialized copy). AVX-512 builds keep the plain loop: not
 * measured there. */
#define HELD_SUMS 12
#define HELD_ROWS 3 /* at 4 bit planes, the most rows whose sums fit in HELD_SUMS */

/* Whether value_page_held serves a side of `bits`-bit codes in groups of G channels with `rows`
 * query rows: codes of at most 2 bits, unpacked in whole vectors (as in dequantize_token), and the
 * sums of every row over one vector of code bytes (8 / B vectors of values) fit in HELD_SUMS. */
ALWAYS_INLINE int held_sums_fit(int B, int G, int rows) {
    return B <= 2 && (G * B / 8) % LANES == 0 && rows <= HELD_ROWS && rows * (8 / B) <= HELD_SUMS;
}

/* Block b of a head's code bytes (LANES bytes of group b / blocks_per_group, at byte
 * b % blocks_per_group * LANES in it): the column where its bit plane i starts in plane order. */
ALWAYS_INLINE int plane_column(int b, int i, int G, int group_bytes, int blocks_per_group) {
    return b / blocks_per_group * G + i * group_bytes + b % blocks_per_group * LANES;
}

/* Pass 2 over one page with each row's value sums held in vector registers (R rows, a constant in
 * the copies value_page dispatches to). Per token the codes are unpacked and dequantized in
 * registers (Eq. 2, x = s Q + m, as dequantize_token) and go straight into every row's sums:
 * no dequantized row is stored and read back, and the sums are loaded and stored once per chunk,
 * not once per token. A chunk is as many vectors of code bytes (each 8 / B vectors of values, one
 * per bit plane) as HELD_SUMS allows. Each sum sees the same fmaf(p, x, sum) in the same token
 * order as the plain loop, so the bits match it; a row whose p is 0 adds 0 * x = 0 (x is finite)
 * where the plain loop skips it. */
ALWAYS_INLINE void value_page_held(const struct tier_pages *restrict tp, int D, int B, int G, int R,
                                   const uint8_t *restrict page, const float *restrict pl, float *restrict ah) {
    const int tokens = tp->tokens, nb = lk_row_bytes(D, B), mb = meta_bytes(D, B, G);
    const int per_byte = 8 / B, group_bytes = G / per_byte, blocks_per_group = group_bytes / LANES;
    const int blocks = D / G * blocks_per_group, chunk = HELD_SUMS / (R * per_byte) < blocks
                                                               ? HELD_SUMS / (R * per_byte) : blocks;
    const lanes_i vmask = lanes_set1_epi32((1 << B) - 1);
    for (int b0 = 0; b0 < blocks; b0 += chunk) {
        const int n = blocks - b0 < chunk ? blocks - b0 : chunk;
        lanes_f sum[HELD_ROWS][HELD_SUMS];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < n; ++c)
                for (int i = 0; i < per_byte; ++i)
                    sum[r][c * per_byte + i] =
                        lanes_loadu_ps(ah + r * D + plane_column(b0 + c, i, G, group_bytes, blocks_per_group));
        for (int t = 0; t < tokens; ++t) {
            float pr[HELD_ROWS];
            int any = 0;
            for (int r = 0; r < R; ++r) {
                pr[r] = pl[r * tokens + t];
                any |= pr[r] != 0.0f;
            }
            if (!any) continue; /* dead, after every query, or underflowed: adds nothing */
            const uint8_t *restrict codes = page + tp->data_off + (int64_t)t * nb;
            const uint8_t *restrict meta = page + tp->meta_off + (int64_t)t * mb;
            for (int c = 0; c < n; ++c) {
                const int g = (b0 + c) / blocks_per_group; /* block b0 + c is code bytes (b0 + c) * LANES */
                const lanes_f vs = lanes_set1_ps(half_at(meta + 4 * g)), vm = lanes_set1_ps(half_at(meta + 4 * g + 2));
                const lanes_i bytes = lanes_widen_bytes(codes + (b0 + c) * LANES);
                for (int i = 0; i < per_byte; ++i) {
                    const lanes_i q = lanes_and(lanes_srli(bytes, i * B), vmask);
                    const lanes_f x = lanes_fmadd_ps(vs, lanes_cvt_ps(q), vm);
                    for (int r = 0; r < R; ++r)
                        sum[r][c * per_byte + i] = lanes_fmadd_ps(lanes_set1_ps(pr[r]), x, sum[r][c * per_byte + i]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < n; ++c)
                for (int i = 0; i < per_byte; ++i)
                    lanes_storeu_ps(ah + r * D + plane_column(b0 + c, i, G, group_bytes, blocks_per_group),
                                    sum[r][c * per_byte + i]);
    }
}
#endif /* LANES == 8 */

/* RB query rows' weighted values over a block of n dequantized tokens x_j (xs[j], slot live[j]):
 * for each row r, sum[c] = fmaf(p, x_j[c], sum[c]) for j = 0..n-1 in order, p = pl[r * tokens +
 * live[j]], sum = ah + r * D. A row whose p is 0 adds 0 * x, a zero (x is finite: only weighed
 * slots are listed), which leaves its sum as the token-at-a-time loop's skip does (sums start at +0
 * and so never become -0), so the bits match that loop's. With vector lanes the sums stay in
 * registers across the block, RB rows of VALUE_CHUNK vectors at a time: one FMA chain per row and
 * token would wait on the FMA's latency, so the RB x VALUE_CHUNK independent sums are what keeps
 * the FMA units busy. */
#if defined(LANES) && LANES == 16
#define VALUE_CHUNK 4
#define VALUE_ROWS 4 /* 16 sums, 4 value vectors and the broadcasts: 21 of 32 registers */
#else /* AVX2; a build without vector lanes adds one row at a time whatever RB is */
#define VALUE_CHUNK 4
#define VALUE_ROWS 2 /* 8 sums, 4 value vectors and the broadcasts: 13 of 16 registers */
#endif
ALWAYS_INLINE void rows_block_values(float *restrict ah, const float *restrict pl, int tokens, int RB,
                                     const int *restrict live, const float *const *restrict xs, int n, int D) {
#ifdef LANES
    if (D % LANES == 0) {
        for (int c0 = 0; c0 < D; c0 += VALUE_CHUNK * LANES) {
            const int nv = (D - c0) / LANES < VALUE_CHUNK ? (D - c0) / LANES : VALUE_CHUNK;
            lanes_f sum[VALUE_ROWS][VALUE_CHUNK];
            for (int r = 0; r < RB; ++r)
                for (int v = 0; v < nv; ++v) sum[r][v] = lanes_loadu_ps(ah + (size_t)r * D + c0 + v * LANES);
            for (int j = 0; j < n; ++j) {
                const float *restrict x = xs[j] + c0;
                lanes_f xv[VALUE_CHUNK];
                for (int v = 0; v < nv; ++v) xv[v] = lanes_loadu_ps(x + v * LANES);
                for (int r = 0; r < RB; ++r) {
                    const lanes_f vp = lanes_set1_ps(pl[(size_t)r * tokens + live[j]]);
                    for (int v = 0; v < nv; ++v) sum[r][v] = lanes_fmadd_ps(vp, xv[v], sum[r][v]);
                }
            }
            for (int r = 0; r < RB; ++r)
                for (int v = 0; v < nv; ++v) lanes_storeu_ps(ah + (size_t)r * D + c0 + v * LANES, sum[r][v]);
        }
        return;
    }
#endif
    for (int r = 0; r < RB; ++r) {
        float *restrict ar = ah + (size_t)r * D;
        for (int j = 0; j < n; ++j) {
            const float p = pl[(size_t)r * tokens + live[j]];
            if (p == 0.0f) continue;
            const float *restrict x = xs[j];
            for (int c = 0; c < D; ++c) ar[c] = fmaf(p, x[c], ar[c]);
        }
    }
}

/* Tokens value_page_rows dequantizes at most before the rows add them: 32 at head_dim 64, fewer
 * where a head's tokens are wider, so the block stays at 8 KB, in the L1 cache, and a decode step's
 * few rows keep their scratch on the stack (STACK_FLOATS). */
#define VALUE_BLOCK 32
#define VALUE_BLOCK_FLOATS 2048
ALWAYS_INLINE int value_block_tokens(int D) {
    const int fit = VALUE_BLOCK_FLOATS / D;
    return fit < 1 ? 1 : fit > VALUE_BLOCK ? VALUE_BLOCK : fit;
}

/* Pass 2 over one page for many query rows (a long step's chunk of queries times the group): the
 * token-at-a-time loop below sweeps every row's sums once per token, and at hundreds of rows those
 * ([rows, D] floats, 96 KB at 384 x 64) no longer fit the L1 cache, so each token's update ran at
 * L2 speed. Here the page's tokens are cut into blocks of about equal size (at most
 * value_block_tokens), each block's live tokens dequantized first (value: that many x D floats),
 * then the rows add the whole block with their sums held (rows_block_values): one sweep of the sums
 * per block, not per token. Every sum sees the same operations in the same token order as the
 * token-at-a-time loop. */
ALWAYS_INLINE void value_page_rows(const struct tier_pages *restrict tp, int D, int B, int G,
                                   const uint8_t *restrict page, const float *restrict pl, float *restrict ah,
                                   float *restrict value) {
    const int tokens = tp->tokens, rows = tp->rows, nb = lk_row_bytes(D, B), mb = meta_bytes(D, B, G);
    if (tokens <= 0) return;
    const int most = value_block_tokens(D), blocks = (tokens + most - 1) / most, size = (tokens + blocks - 1) / blocks;
    int live[VALUE_BLOCK];
    unsigned char weighed[VALUE_BLOCK];
    const float *xs[VALUE_BLOCK];
    for (int t0 = 0; t0 < tokens; t0 += size) {
        const int span = tokens - t0 < size ? tokens - t0 : size;
        /* which tokens some row weighs, rows outer so the inner loop runs over consecutive slots */
        memset(weighed, 0, sizeof weighed);
        for (int r = 0; r < rows; ++r) {
            const float *restrict pr = pl + (size_t)r * tokens + t0;
            for (int j = 0; j < span; ++j) weighed[j] |= pr[j] != 0.0f;
        }
        int n = 0;
        for (int j = 0; j < span; ++j) {
            if (!weighed[j]) continue; /* dead, after every query, or underflowed: adds nothing */
            const int64_t t = t0 + j;
            if (B == LK_DENSE_F32) { /* fp32 values are read in place, not copied */
                xs[n] = (const float *)(page + tp->data_off + t * nb);
            } else {
                dequantize_token(page + tp->data_off + t * nb, page + tp->meta_off + t * mb, D, B, G,
                                 value + (size_t)n * D);
                xs[n] = value + (size_t)n * D;
            }
            live[n++] = (int)t;
        }
        if (n == 0) continue;
        int r = 0;
        for (; r + VALUE_ROWS <= rows; r += VALUE_ROWS)
            rows_block_values(ah + (size_t)r * D, pl + (size_t)r * tokens, tokens, VALUE_ROWS, live, xs, n, D);
        float *restrict rest = ah + (size_t)r * D;
        const float *restrict rest_p = pl + (size_t)r * tokens;
        /* the last rows (fewer than VALUE_ROWS) together too, with a constant count (3 query heads a
         * group are common) */
        switch (rows - r) {
        case 1: rows_block_values(rest, rest_p, tokens, 1, live, xs, n, D); break;
#if VALUE_ROWS > 2
        case 2: rows_block_values(rest, rest_p, tokens, 2, live, xs, n, D); break;
        case 3: rows_block_values(rest, rest_p, tokens, 3, live, xs, n, D); break;
#endif
        }
    }
}

/* Query rows from which pass 2 takes value_page_rows (bench/native_passes.py --rows N --against REV,
 * docs/measurements.md): from 2 rows it was faster on every config measured, on AVX-512 and AVX2
 * builds (where 2-bit values with up to 3 rows keep value_page_held, faster still); at 1 row the two
 * loops are within noise, so it keeps the token-at-a-time loop. */
#define VALUE_ROWS_MIN 2

/* Pass 2 over one page's live tokens: acc[r] += p[r, t] * value(t) for the slots some row weighs. */
ALWAYS_INLINE void value_page(const struct tier_pages *restrict tp, int D, int B, int G, const uint8_t *restrict page,
                              const float *restrict pl, float *restrict ah, float *restrict value, int fixed) {
    const int tokens = tp->tokens, rows = tp->rows, nb = lk_row_bytes(D, B), mb = meta_bytes(D, B, G);
#if defined(LANES) && LANES == 8
    /* fixed: D, B and G are compile-time constants here (a specialized copy), so the held sums are
     * registers; in the run-time geometry copy they would be an array in memory */
    if (fixed && held_sums_fit(B, G, rows)) {
        switch (rows) {
        case 1: value_page_held(tp, D, B, G, 1, page, pl, ah); return;
        case 2: value_page_held(tp, D, B, G, 2, page, pl, ah); return;
        default: value_page_held(tp, D, B, G, 3, page, pl, ah); return;
        }
    }
#endif
    if (rows >= VALUE_ROWS_MIN) {
        value_page_rows(tp, D, B, G, page, pl, ah, value);
        return;
    }
    for (int t = 0; t < tokens; ++t) {
        int any = 0;
        for (int r = 0; r < rows; ++r) any |= pl[r * tokens + t] != 0.0f;
        if (!any) continue; /* dead, after every query, or underflowed: adds nothing */
        const float *restrict x = value;
        if (B == LK_DENSE_F32) /* fp32 values are read in place, not copied */
            x = (const float *)(page + tp->data_off + (int64_t)t * nb);
        else
            dequantize_token(page + tp->data_off + (int64_t)t * nb, page + tp->meta_off + (int64_t)t * mb, D, B, G,
                             value);
        for (int r = 0; r < rows; ++r) {
            const float pr = pl[r * tokens + t];
            if (pr == 0.0f) continue;
            float *restrict ar = ah + r * D;
            for (int c = 0; c < D; ++c) ar[c] = fmaf(pr, x[c], ar[c]);
        }
    }
}

#define SCORE_PAGE_ARGS                                                                                     \
    const struct tier_pages *restrict tp, const uint8_t *restrict page, int64_t left, const float *restrict qh, \
        const int32_t *restrict qp, float *restrict mh, float *restrict ol, int32_t *restrict pos_l,            \
        uint8_t *restrict valid_l, float *restrict score_l, float *restrict key
#define VALUE_PAGE_ARGS \
    const struct tier_pages *restrict tp, const uint8_t *restrict page, const float *restrict pl, float *restrict ah, \
        float *restrict value
typedef void (*score_page_fn)(SCORE_PAGE_ARGS);
typedef void (*value_page_fn)(VALUE_PAGE_ARGS);

/* Any geometry, read at run time. */
static void score_page_any(SCORE_PAGE_ARGS) {
    score_page(tp, tp->dim, tp->bits, tp->group_size, page, left, qh, qp, mh, ol, pos_l, valid_l, score_l, key);
}
static void value_page_any(VALUE_PAGE_ARGS) {
    value_page(tp, tp->dim, tp->bits, tp->group_size, page, pl, ah, value, 0);
}

/* Copies with the common geometries fixed at compile time (head_dim 64, 128 and 256; 8-, 4- and
 * 2-bit codes in groups of 32 channels up to the whole head; dense fp32, fp16 and bf16 sides):
 * every per-token loop then has a constant trip count, so a token's dequantization and each row's
 * dot product compile to straight vector code. */
#define SPECIALIZED(X) \
    X(64, 8, 32) X(64, 4, 32) X(64, 2, 32) X(64, 8, 64) X(64, 4, 64) X(64, 2, 64) \
    X(128, 8, 32) X(128, 4, 32) X(128, 2, 32) X(128, 8, 64) X(128, 4, 64) X(128, 2, 64) \
    X(128, 8, 128) X(128, 4, 128) X(128, 2, 128) \
    X(256, 8, 32) X(256, 4, 32) X(256, 2, 32) X(256, 8, 64) X(256, 4, 64) X(256, 2, 64) \
    X(256, 8, 128) X(256, 4, 128) X(256, 2, 128) X(256, 8, 256) X(256, 4, 256) X(256, 2, 256) \
    X(64, 32, 64) X(64, 16, 64) X(64, 17, 64) X(128, 32, 128) X(128, 16, 128) X(128, 17, 128) \
    X(256, 32, 256) X(256, 16, 256) X(256, 17, 256)
#define DEFINE_PAGE_FNS(D, B, G)                                                                            \
    static void score_page_##D##_##B##_##G(SCORE_PAGE_ARGS) {                                              \
        score_page(tp, D, B, G, page, left, qh, qp, mh, ol, pos_l, valid_l, score_l, key);                   \
    }                                                                                                      \
    static void value_page_##D##_##B##_##G(VALUE_PAGE_ARGS) { value_page(tp, D, B, G, page, pl, ah, value, 1); }
SPECIALIZED(DEFINE_PAGE_FNS)

static score_page_fn pick_score_page(int dim, int bits, int group_size) {
#define PICK_SCORE(D, B, G) \
    if (dim == D && bits == B && group_size == G) return score_page_##D##_##B##_##G;
    SPECIALIZED(PICK_SCORE)
    return score_page_any;
}

static value_page_fn pick_value_page(int dim, int bits, int group_size) {
#define PICK_VALUE(D, B, G) \
    if (dim == D && bits == B && group_size == G) return value_page_##D##_##B##_##G;
    SPECIALIZED(PICK_VALUE)
    return value_page_any;
}

/* 1 if (dim, bits, group_size) runs a specialized copy of the page loops, else 0 (the generic one). */
int lk_specialized(int dim, int bits, int group_size) {
    return pick_score_page(dim, bits, group_size) != score_page_any;
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
    const int bad = check_pages(page_id, head, n_pages, pool_pages);
    if (bad) return bad;
    const struct tier_pages tp = {tokens, dim, rows, bits, group_size, data_off, meta_off, pos_off, score_off,
                                  page_bytes};
    const score_page_fn score = pick_score_page(dim, bits, group_size);
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Per thread, a block of dequantized keys and the current head's query rows in plane order:
         * on the stack when they fit (measured ~5% faster than the heap), else allocated, so no head_dim
         * or rows limit. */
#ifdef LANES
        const size_t blocks = rows >= SCORE_ROWS_MIN ? 2 : 1; /* the block, and its transpose (score_page) */
#else
        const size_t blocks = 1;
#endif
        const size_t need = (size_t)dim * (TOKEN_BLOCK * blocks + (size_t)rows);
        float stack[STACK_FLOATS];
        float *restrict key = need <= STACK_FLOATS ? stack : malloc(sizeof(float) * need);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        failed = key == NULL;
        if (key) memset(key, 0, sizeof(float) * (size_t)dim * TOKEN_BLOCK * blocks); /* whole blocks are read */
        float *restrict q_planes = failed ? NULL : key + (size_t)dim * TOKEN_BLOCK * blocks;
        int64_t prev = -1;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            const int64_t h = head[l], slot0 = l * tokens;
            if (l + 1 < l1) prefetch_page(pool + page_id[l + 1] * page_bytes, &tp, 1, score_out != NULL);
            if (h != prev) to_planes(q + h * rows * dim, q_planes, rows, dim, bits, group_size);
            prev = h;
            score(&tp, pool + page_id[l] * page_bytes, (int64_t)lens[h] - rank[l] * tokens, q_planes,
                  q_pos + h * rows, m + h * rows, out + l * rows * tokens, pos_out ? pos_out + slot0 : NULL,
                  valid_out ? valid_out + slot0 : NULL, score_out ? score_out + slot0 : NULL, key);
        }
        if (key != stack) free(key);
    }
    return failed ? LK_NO_MEMORY : 0;
}

/* pr[t] = e^(pr[t] - sh) for the `tokens` slots of one query row of a page; returns their sum.
 * AVX2: in intrinsics, with a page's last, partial vector of slots computed as a vector too
 * (masked load, store_first) where the compiler's own loop took it one slot at a time: pass 2 in
 * 0.97-0.99x the time of that loop (with Horner's steps fused in both). */
ALWAYS_INLINE float row_numerators(float *restrict pr, int tokens, float sh) {
#if defined(LANES) && LANES == 8
    const __m256 shift = _mm256_set1_ps(sh);
    __m256 total = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= tokens; t += 8) {
        const __m256 e = exp_numerators8(_mm256_sub_ps(_mm256_loadu_ps(pr + t), shift));
        _mm256_storeu_ps(pr + t, e);
        total = _mm256_add_ps(total, e);
    }
    if (t < tokens) {
        const __m256i keep = first_lanes(tokens - t);
        const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(pr + t, keep), shift);
        const __m256 e = _mm256_and_ps(exp_numerators8(x), _mm256_castsi256_ps(keep));
        store_first(pr + t, e, tokens - t);
        total = _mm256_add_ps(total, e);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
#else /* one branch-free loop that the compiler vectorizes */
    float total = 0.0f;
    for (int t = 0; t < tokens; ++t) {
        pr[t] = exp_numerator(pr[t] - sh);
        total += pr[t];
    }
    return total;
#endif
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
    const int bad = check_pages(page_id, head, n_pages, pool_pages);
    if (bad) return bad;
    const struct tier_pages tp = {tokens, dim, rows, bits, group_size, data_off, meta_off, 0, 0, page_bytes};
    const value_page_fn values = pick_value_page(dim, bits, group_size);
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float stack[STACK_FLOATS];
        /* Per thread, the dequantized values (one token, or a block of them for many rows:
         * value_page_rows) and the current head's value sums in plane order. */
        const size_t value_floats = (size_t)dim * (rows >= VALUE_ROWS_MIN ? value_block_tokens(dim) : 1);
        const size_t need = value_floats + (size_t)dim * rows;
        float *restrict value = need <= STACK_FLOATS ? stack : malloc(sizeof(float) * need);
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        failed = value == NULL;
        float *restrict sums = failed ? NULL : value + value_floats;
        if (sums) memset(sums, 0, sizeof(float) * (size_t)rows * dim);
        int64_t prev = -1;
        for (int64_t l = failed ? l1 : l0; l < l1; ++l) {
            const int64_t h = head[l];
            if (h != prev && prev >= 0) add_from_planes(sums, acc + prev * rows * dim, rows, dim, bits, group_size);
            prev = h;
            if (l + 1 < l1) prefetch_page(pool + page_id[l + 1] * page_bytes, &tp, 0, 0);
            float *pl = p + l * rows * tokens;
            /* The page's numerators first, a row at a time. */
            for (int r = 0; r < rows; ++r) l_sum[h * rows + r] += row_numerators(pl + r * tokens, tokens, shift[h * rows + r]);
            values(&tp, pool + page_id[l] * page_bytes, pl, sums, value);
        }
        if (prev >= 0) add_from_planes(sums, acc + prev * rows * dim, rows, dim, bits, group_size);
        if (value != stack) free(value);
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
    int failed = 0;
    threads = team_size(n_pages, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int tid = THREAD_ID, nth = THREAD_COUNT;
        const int64_t l0 = run_start(head, n_pages, tid, nth), l1 = run_start(head, n_pages, tid + 1, nth);
        float stack[STACK_FLOATS];
        float *restrict updated = tokens <= STACK_FLOATS ? stack : malloc(sizeof(float) * (size_t)tokens);
        for (int64_t l = updated ? l0 : l1; l < l1; ++l) {
            const int64_t h = head[l], seq = h / heads_per_seq;
            if (!has[seq]) continue;
            const float first = (float)q_first[seq], last = (float)q_last[seq];
            const float *w = row_weight + h * rows, *pl = p + l * rows * tokens, *sl = stored + l * tokens;
            const int32_t *posl = pos + l * tokens;
            const uint8_t *vl = valid + l * tokens;
            uint8_t *seg = pool + page_id[l] * page_bytes + score_off;
            /* The page's new scores first, over all its slots at once (one loop per row that
             * vectorizes; dead slots compute junk that is never written), then their fp16 bytes. */
            for (int t = 0; t < tokens; ++t) updated[t] = 0.0f;
            for (int r = 0; r < rows; ++r)
                for (int t = 0; t < tokens; ++t) updated[t] += pl[r * tokens + t] * w[r];
            for (int t = 0; t < tokens; ++t) {
                const float ps = (float)posl[t], s = sl[t], before = first - ps;
                float n = last - ps + 1.0f;
                n = n < 1.0f ? 1.0f : n;
                const float m = n - (before < 0.0f ? 0.0f : before);
                updated[t] = s + (updated[t] - s * m) / n;
            }
            for (int t = 0; t < tokens; ++t) {
                if (!vl[t]) continue;
                const uint16_t out = float_to_half(updated[t]);
                memcpy(seg + 2 * (int64_t)t, &out, sizeof out);
            }
        }
        failed = updated == NULL;
        if (updated != stack) free(updated);
    }
    return failed ? LK_NO_MEMORY : 0;
}

/* 1 if this build splits its loops over threads (built with OpenMP), else 0. */
int lk_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
