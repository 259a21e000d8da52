/* The entry points of leankit's compiled CPU kernels that one C file calls in another
 * (decode_step.c composes the passes of a decode step, prompt_store.c a LeanKV prompt's layer),
 * declared once so the compiler checks every call against the definition. Python binds them by
 * name (leankit/native/__init__.py). */
#ifndef LEANKIT_KERNELS_H
#define LEANKIT_KERNELS_H

#include <stdint.h>

int64_t lk_list_pages(const int32_t *restrict n_pages, int64_t heads, const int32_t *restrict table,
                      int64_t row_len, int64_t first_col, int64_t col_step, int64_t capacity,
                      int64_t *restrict head, int64_t *restrict rank, int64_t *restrict page_id);

int lk_live_scores(const uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages,
                   const int64_t *restrict page_id, const int64_t *restrict head, const int64_t *restrict rank,
                   int64_t n_pages, int tokens, int dim, int rows, int bits, int group_size, int64_t data_off,
                   int64_t meta_off, int64_t pos_off, int64_t score_off, const float *restrict q,
                   const int32_t *restrict q_pos, const int32_t *restrict lens, float *restrict out,
                   float *restrict m, int32_t *restrict pos_out, uint8_t *restrict valid_out,
                   float *restrict score_out, int threads);

int lk_live_values(const uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages,
                   const int64_t *restrict page_id, const int64_t *restrict head, int64_t n_pages, int tokens,
                   int dim, int rows, int bits, int group_size, int64_t data_off, int64_t meta_off,
                   float *restrict p, const float *restrict shift, float *restrict l_sum, float *restrict acc,
                   int threads);

int lk_update_scores(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int64_t *restrict page_id,
                     const int64_t *restrict head, int64_t n_pages, int tokens, int rows, int64_t score_off,
                     int64_t heads_per_seq, const float *restrict p, const float *restrict row_weight,
                     const int32_t *restrict pos, const uint8_t *restrict valid, const float *restrict stored,
                     const int64_t *restrict q_first, const int64_t *restrict q_last, const uint8_t *restrict has,
                     int threads);

void lk_finish_decode(int64_t heads, int rows, int dim, int heads_per_seq, const float *acc,
                      const float *l_sum, const float *shift, const float *q, const float *k_new,
                      const float *v_new, const uint8_t *real, float *out, float *lse, float *row_weight,
                      float *received);

int lk_store_tokens(uint8_t *restrict pool, int64_t page_bytes, int64_t pool_pages, const int64_t *restrict page_id,
                    const int64_t *restrict slot, int64_t n, int tokens, int dim, int k_bits, int v_bits,
                    int group_size, const int64_t *restrict seg_off, const float *restrict k,
                    const float *restrict v, const int32_t *restrict pos, const float *restrict score, int threads);

int lk_fit_pages(int32_t *restrict tables, int32_t *restrict n_pages, int64_t layers_total, int64_t heads,
                 int64_t heads_per_seq, int64_t row_len, const int64_t *restrict layers, int64_t n_layers,
                 const int64_t *restrict lens, int tiers, const int64_t *restrict reserve, int64_t tokens_high,
                 int64_t tokens_low, const int32_t *restrict ring, int64_t capacity, int64_t head, int64_t tail,
                 int64_t *restrict need, int64_t *restrict taken);

int lk_settle_pages(int32_t *restrict tables, int32_t *restrict n_pages, int32_t *restrict lens, int64_t layers_total,
                    int64_t heads, int64_t row_len, const int64_t *restrict layers, int64_t n_layers,
                    const int64_t *restrict new_lens, const int64_t *restrict need, int32_t *restrict ring,
                    int64_t capacity, int64_t head, int64_t tail, int64_t *restrict freed);

#endif
