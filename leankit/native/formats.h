/* Element formats of a page side, as the `bits` argument of leankit's compiled CPU kernels
 * (shared with leankit/native/__init__.py, DENSE_FORMATS): 1, 2, 4 or 8 are packed integer codes
 * with an fp16 (scale, min) per group (LeanKV Eq. 2); the dense formats hold the model's own
 * values as they are, with no metadata. */
#ifndef LEANKIT_FORMATS_H
#define LEANKIT_FORMATS_H

#define LK_DENSE_F16 16
#define LK_DENSE_BF16 17 /* a 16-bit format numbered apart from fp16 */
#define LK_DENSE_F32 32

/* Bytes of one value of a dense format. */
static inline int lk_dense_size(int bits) { return bits == LK_DENSE_F32 ? 4 : 2; }

/* Bytes of one token's row of a side of dim channels: its packed codes, or its dense values. */
static inline __attribute__((always_inline)) int lk_row_bytes(int dim, int bits) { return bits <= 8 ? dim * bits / 8 : dim * lk_dense_size(bits); }

#endif
