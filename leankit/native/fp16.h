/* IEEE half <-> float conversions shared by leankit's compiled CPU kernels. */
#ifndef LEANKIT_FP16_H
#define LEANKIT_FP16_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

/* IEEE half to float, exact for every input (subnormals, infinities and NaN included): one
 * vcvtph2ps where the CPU has F16C, else by its bit fields. */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
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
#endif
}

/* float to IEEE half, rounding to nearest even as a float-to-half cast does (overflow to
 * infinity, subnormal halves included); NaN stays NaN. */
static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    if (f == f) return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); /* the same bits for every non-NaN */
#endif
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

#endif
