/* Small scalar helpers for the generic translation units (never included by an ISA TU). */
#ifndef KTK_COMMON_H
#define KTK_COMMON_H

#include <stdint.h>
#include <string.h>
#include <time.h>

// Inline forms of libm calls the quantizers would otherwise make per value (these units have no
// -m flags: without SSE4.1 nearbyintf is a call, and fmaxf/fminf's NaN rules keep them calls).
// ktk_round_even: nearbyintf in the default rounding mode for |v| < 2^22 (quantized values are at
// most 127 in magnitude): v + 1.5 * 2^23 lands where the float spacing is 1, rounded to the
// nearest, ties to even, and subtracting gives it back exactly; NaN and infinities pass through.
static inline float ktk_round_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;
}
// fmaxf(a, b) for a number b: a NaN a gives b, as fmaxf does (so does ktk_clamp for its bound)
static inline float ktk_max_or(float a, float b) { return a > b ? a : b; }
// v clamped to [lo, hi], a NaN v to lo: fminf(fmaxf(v, lo), hi)
static inline float ktk_clamp(float v, float lo, float hi) {
  v = v > lo ? v : lo;
  return v < hi ? v : hi;
}

static inline float ktk_bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t ktk_f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float ktk_f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline int64_t ktk_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t ktk_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#endif
