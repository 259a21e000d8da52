/* leankit's compiled finish of a decode step's attention: the step's own token, the merge and
 * the normalization, in one call per layer.
 *
 * After the two passes over the live pages (live_attention.c), each query row r of a (sequence,
 * KV head) h holds the unnormalized value sums acc(h, r, :), the sum l(h, r) of its softmax
 * numerators and the shift c(h, r) they were taken against (0 and l = 0 for a row that saw no
 * stored key). A decode step's query also sees its own new token, at its exact key and value
 * (never quantized). With s = q_r . k_new (q_r already scaled), the softmax over both is, in closed
 * form (the flash-decoding split merge where one side is a single key):
 *
 *   M      = max(c, s)          (s alone when l = 0)
 *   Z      = l e^{c - M} + e^{s - M}
 *   out_r  = (acc e^{c - M} + v_new e^{s - M}) / Z
 *   lse_r  = M + log Z
 *
 * For LeanKV's running significance (§4) it also gives what each row's page numerators count for
 * in the mass the stored tokens received, w(h, r) = e^{c - lse_r} / G (0 for a row of a sequence
 * whose token is not real, or one that saw no stored key), and the mass the new token itself
 * received, sum_r e^{s - lse_r} / G (0 when its token is not real).
 *
 * In the torch path this was about twenty small tensor ops per layer (normalize, the one-token
 * attention, the log-sum-exp merge, the significance's row factors), which at short contexts cost
 * more than the passes over the pages. The work itself is rows x head_dim per (sequence, head):
 * one thread, no scratch.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* heads: B * Hkv (sequence-major); rows: G query rows per head (one query each); dim: head_dim;
 * heads_per_seq: Hkv; acc [heads, rows, dim], l_sum and shift [heads, rows]; q [heads, rows, dim]
 * scaled queries; k_new and v_new [heads, dim] the step's token (the basis the pages hold);
 * real [heads / heads_per_seq] 0/1. Writes out [heads, rows, dim] and lse [heads, rows]; writes
 * row_weight [heads, rows] and received [heads] when not NULL. out may alias acc. */
void lk_finish_decode(int64_t heads, int rows, int dim, int heads_per_seq, const float *acc,
                      const float *l_sum, const float *shift, const float *q, const float *k_new,
                      const float *v_new, const uint8_t *real, float *out, float *lse, float *row_weight,
                      float *received) {
    const float inv_group = 1.0f / (float)rows;
    for (int64_t h = 0; h < heads; ++h) {
        const float *kh = k_new + h * dim, *vh = v_new + h * dim;
        const int live = real[h / heads_per_seq] != 0;
        float new_mass = 0.0f;
        for (int r = 0; r < rows; ++r) {
            const int64_t hr = h * rows + r;
            const float *qr = q + hr * dim;
            float s = 0.0f;
            for (int d = 0; d < dim; ++d) s += qr[d] * kh[d];
            const float l = l_sum[hr], c = shift[hr];
            const int seen = l > 0.0f;
            const float top = seen && c > s ? c : s;
            const float w_old = seen ? expf(c - top) : 0.0f, w_new = expf(s - top);
            const float z = l * w_old + w_new;
            const float a = w_old / z, b = w_new / z;
            const float *ar = acc + hr * dim;
            float *o = out + hr * dim;
            for (int d = 0; d < dim; ++d) o[d] = ar[d] * a + vh[d] * b;
            const float total = top + logf(z);
            lse[hr] = total;
            if (row_weight) row_weight[hr] = live && seen ? expf(c - total) * inv_group : 0.0f;
            new_mass += expf(s - total);
        }
        if (received) received[h] = live ? new_mass * inv_group : 0.0f;
    }
}
