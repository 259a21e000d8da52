/* Error codes of leankit's compiled CPU kernels, shared with leankit/native/__init__.py (ERRORS). */
#ifndef LEANKIT_ERRORS_H
#define LEANKIT_ERRORS_H

#include <math.h>
#include <stdint.h>

#define LK_NO_MEMORY (-1)  /* no memory for a kernel's scratch */
#define LK_BAD_PAGE (-2)   /* a page id outside the pool (or, for a store, a slot outside its page) */
#define LK_UNSORTED (-3)   /* pages not grouped by head */
#define LK_OVERFLOW (-4)   /* more live pages than the output holds */
#define LK_NON_FINITE (-5) /* a key or value to store holds NaN or Inf */
#define LK_META_RANGE (-6) /* a group's scale to store does not fit fp16 */
#define LK_NO_SLOTS (-7)   /* a significance update without the slots pass 1 keeps for it */
#define LK_NON_FINITE_QK (-8) /* a decode step that updates significance got a NaN/Inf query or key */
#define LK_NEGATIVE_DEMAND (-9) /* a page grant asks for a negative number of pages */
#define LK_ROW_FULL (-10)       /* a page grant would give a row more pages than it has columns */
#define LK_POOL_SHORT (-11)     /* a page grant asks for more pages than the free list holds */
#define LK_DOUBLE_FREE (-12)    /* a recycle returns more pages than are handed out */
#define LK_BAD_MOVE (-13)       /* a hand-over or plan names a layer, or moves pages, outside the table */

/* 1 if the n floats at x are all finite, else 0: the check behind LK_NON_FINITE and LK_NON_FINITE_QK
 * (a branch-free pass; n is a token's row or a decode step's queries and keys). */
static inline int lk_all_finite(const float *restrict x, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= !isfinite(x[i]);
    return !bad;
}

#endif
