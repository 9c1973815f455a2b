// AVX2 + FMA micro kernels. Compiled with -mavx2 -mfma -mf16c only; everything except the exported
// ops table getter has internal linkage (anonymous namespace) and no std:: templates are used, so
// no code from here can be picked by the linker for another ISA's translation unit (and vice versa).
#include <immintrin.h>

#include "ktk.h"

namespace {

// Decode streams weights from DRAM: ask for them this far ahead (past a block's end, that is the
// next block of the same run). Development machine, 2 threads, T=1, Qwen3 shapes, alternated with
// the code without: int8 598-621 us vs 664-685, int4 388-403 vs 428-435.
constexpr int kPrefetchBytes = 4096;

inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

inline __m256 bf16x8_to_f32(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256i bcast32(const void* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

template <int MT>
void dot_bf16_tile(const uint16_t* w, int K, const uint16_t* x, int ldx, float* out) {
  const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
  __m256 acc[MT][2], odd[MT][2];  // even and odd k in separate chains
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = odd[m][0] = odd[m][1] = _mm256_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    prefetch_ahead(w + p * 32);
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
    __m256 w0e = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    __m256 w0o = _mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask));
    __m256 w1e = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    __m256 w1o = _mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask));
    for (int m = 0; m < MT; ++m) {
      __m256i xb = bcast32(x + size_t(m) * ldx + 2 * p);
      __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
      __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xb, hi_mask));
      acc[m][0] = _mm256_fmadd_ps(w0e, xe, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1e, xe, acc[m][1]);
      odd[m][0] = _mm256_fmadd_ps(w0o, xo, odd[m][0]);
      odd[m][1] = _mm256_fmadd_ps(w1o, xo, odd[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(out + m * 16, _mm256_add_ps(acc[m][0], odd[m][0]));
    _mm256_storeu_ps(out + m * 16 + 8, _mm256_add_ps(acc[m][1], odd[m][1]));
  }
}

void dot_bf16(const uint16_t* w, int K, const uint16_t* x, int ldx, int M, float* out) {
  int m = 0;
  for (; m + 4 <= M; m += 4) dot_bf16_tile<4>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 2 <= M; m += 2) dot_bf16_tile<2>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m < M; ++m) dot_bf16_tile<1>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
}

// bf16 weights, fp32 activations (the exact mode): the 32-bit lanes of a pair vector hold
// [w(2p) | w(2p+1) << 16]; shift left by 16 / mask the low half widen them to fp32 exactly.
// Rows 0-7 and 8-15 are two ymm halves; each token's even and odd k go into the same chain.
template <int MT>
void dot_f32x_tile(const uint16_t* w, int K, const float* x, int ldx, float* out) {
  const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
    __m256 w0e = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    __m256 w0o = _mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask));
    __m256 w1e = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    __m256 w1o = _mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask));
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + size_t(m) * ldx + 2 * p;
      __m256 xe = _mm256_broadcast_ss(xm), xo = _mm256_broadcast_ss(xm + 1);
      acc[m][0] = _mm256_fmadd_ps(w0o, xo, _mm256_fmadd_ps(w0e, xe, acc[m][0]));
      acc[m][1] = _mm256_fmadd_ps(w1o, xo, _mm256_fmadd_ps(w1e, xe, acc[m][1]));
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(out + m * 16, acc[m][0]);
    _mm256_storeu_ps(out + m * 16 + 8, acc[m][1]);
  }
}

// One token: two pairs per step, even and odd k apart: eight chains (K/2 is a multiple of 32).
void dot_f32x_one(const uint16_t* w, int K, const float* x, float* out) {
  const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int p = 0; p < K / 2; p += 2) {
    for (int j = 0; j < 2; ++j) {
      const uint16_t* wp = w + (p + j) * 32;
      prefetch_ahead(wp);
      __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
      __m256 xe = _mm256_broadcast_ss(x + 2 * (p + j)), xo = _mm256_broadcast_ss(x + 2 * (p + j) + 1);
      __m256* aj = a + 4 * j;
      aj[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), xe, aj[0]);
      aj[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask)), xo, aj[1]);
      aj[2] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), xe, aj[2]);
      aj[3] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask)), xo, aj[3]);
    }
  }
  __m256 lo = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[4], a[5]));
  __m256 hi = _mm256_add_ps(_mm256_add_ps(a[2], a[3]), _mm256_add_ps(a[6], a[7]));
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
}

void dot_bf16_f32(const uint16_t* w, int K, const float* x, int ldx, int M, float* out) {
  if (M == 1) return dot_f32x_one(w, K, x, out);
  int m = 0;
  for (; m + 4 <= M; m += 4) dot_f32x_tile<4>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 2 <= M; m += 2) dot_f32x_tile<2>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m < M; ++m) dot_f32x_tile<1>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
}

// int8 x int8 with the sign trick: maddubs(|x|, sign(w, x)) never saturates for |q| <= 127.
template <int MT>
void dot_int8_tile(const int8_t* w, const float* ws, int K, const int8_t* x, int ldx,
                   const float* xs, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int q = 0; q < K / 4; ++q) {
    prefetch_ahead(w + q * 64);
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32));
    for (int m = 0; m < MT; ++m) {
      __m256i xb = bcast32(x + size_t(m) * ldx + 4 * q);
      __m256i ax = _mm256_abs_epi8(xb);
      __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
      __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(p0, ones));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(p1, ones));
    }
  }
  __m256 s0 = _mm256_loadu_ps(ws), s1 = _mm256_loadu_ps(ws + 8);
  for (int m = 0; m < MT; ++m) {
    __m256 xsb = _mm256_set1_ps(xs[m]);
    _mm256_storeu_ps(out + m * 16, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(s0, xsb)));
    _mm256_storeu_ps(out + m * 16 + 8,
                     _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(s1, xsb)));
  }
}

void dot_int8(const int8_t* w, const float* ws, const int32_t*, int K, const int8_t* x, int ldx,
              const float* xs, int M, float* out) {
  int m = 0;
  for (; m + 4 <= M; m += 4) dot_int8_tile<4>(w, ws, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
  for (; m + 2 <= M; m += 2) dot_int8_tile<2>(w, ws, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
  for (; m < M; ++m) dot_int8_tile<1>(w, ws, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
}

// int4: nibbles (value + 8, unsigned) times signed int8 x; per group: -8 * sum(x) correction.
template <int MT>
void dot_int4_tile(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
                   const float* xs, const int32_t* xg, int ldg, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nib = _mm256_set1_epi8(0x0f);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < K / 32; ++g) {
    __m256i s16[MT][2];
    for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 256;
    for (int i = 0; i < 256; i += 64) prefetch_ahead(wg + i);
    if (!(g & 1)) _mm_prefetch(reinterpret_cast<const char*>(gs + g * 16) + kPrefetchBytes / 8, _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + 32));
      __m256i lo0 = _mm256_and_si256(v0, nib), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
      __m256i lo1 = _mm256_and_si256(v1, nib), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + size_t(m) * ldx + g * 32;
        __m256i xl = bcast32(xm + 4 * c), xh = bcast32(xm + 4 * (c + 4));
        s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                  _mm256_maddubs_epi16(hi0, xh)));
        s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                  _mm256_maddubs_epi16(hi1, xh)));
      }
    }
    __m256 sc0 = bf16x8_to_f32(gs + g * 16), sc1 = bf16x8_to_f32(gs + g * 16 + 8);
    for (int m = 0; m < MT; ++m) {
      __m256i corr = _mm256_set1_epi32(8 * xg[size_t(m) * ldg + g]);
      __m256i i0 = _mm256_sub_epi32(_mm256_madd_epi16(s16[m][0], ones), corr);
      __m256i i1 = _mm256_sub_epi32(_mm256_madd_epi16(s16[m][1], ones), corr);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), sc0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), sc1, acc[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 xsb = _mm256_set1_ps(xs[m]);
    _mm256_storeu_ps(out + m * 16, _mm256_mul_ps(acc[m][0], xsb));
    _mm256_storeu_ps(out + m * 16 + 8, _mm256_mul_ps(acc[m][1], xsb));
  }
}

void dot_int4_block(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
                    const float* xs, const int32_t* xg, int ldg, int M, float* out) {
  int m = 0;
  for (; m + 2 <= M; m += 2)
    dot_int4_tile<2>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg,
                     out + m * 16);
  for (; m < M; ++m)
    dot_int4_tile<1>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg,
                     out + m * 16);
}

void dot_int4(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
              const float* xs, const int32_t* xg, int ldg, int M, int nb, float* out, size_t ldo) {
  for (int b = 0; b < nb; ++b)
    dot_int4_block(w + b * ktk_int4_block_bytes(K), gs + b * ktk_int4_block_scales(K), K, x, ldx,
                   xs, xg, ldg, M, out + b * ldo);
}

uint64_t read_xor(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 0)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  uint64_t r = 0;
  for (uint64_t v : lanes) r ^= v;
  return r;
}

// e^x: x clamped to [-87, 88] (a NaN passes through), reduced by n ln 2 in two parts (Cody-Waite),
// e^r for |r| <= ln(2) / 2 by Cephes' degree-6 polynomial (expf's error, within 2 ulp), times 2^n
// built in the exponent bits (n in [-126, 127]: a normal float).
inline __m256 exp_ps(__m256 x) {
  // max/min return their second operand where either is NaN: a NaN x stays NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

void silu_mul16(const float* gate, const float* up, int rows, float* h, int ldh) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int m = 0; m < rows; ++m)
    for (int half = 0; half < 16; half += 8) {
      const __m256 v = _mm256_loadu_ps(gate + m * 16 + half);
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
      const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, e));
      _mm256_storeu_ps(h + size_t(m) * ldh + half, _mm256_mul_ps(s, _mm256_loadu_ps(up + m * 16 + half)));
    }
}

inline __m256 load8_f32(const void* src, int src_dtype, int i) {
  if (src_dtype == KTK_DT_BF16) return bf16x8_to_f32(static_cast<const uint16_t*>(src) + i);
  return _mm256_loadu_ps(static_cast<const float*>(src) + i);
}

inline float load1_f32(const void* src, int src_dtype, int i) {
  if (src_dtype != KTK_DT_BF16) return static_cast<const float*>(src)[i];
  const uint32_t u = uint32_t(static_cast<const uint16_t*>(src)[i]) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// The scalar quantizer's steps (ktk_moe.cpp prep_row) eight values at a time: amax by maxps
// (whose NaN rule, the second operand, is ktk_max_or's), one product v * inv each, rounded half to
// even by cvtps2dq in the default rounding mode as ktk_round_even rounds; a NaN or infinite product
// (NaN inputs; inv infinite after a subnormal amax), which the scalar conversion leaves as 0, is
// zeroed before the saturating packs.
void quantize_int8(const void* src, int src_dtype, int n_real, int n_pad, int8_t* dst,
                   float* scale, int32_t* gsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_setzero_ps();
  const int full8 = n_real / 8 * 8;
  for (int i = 0; i < full8; i += 8)
    amax8 = _mm256_max_ps(_mm256_and_ps(load8_f32(src, src_dtype, i), abs_mask), amax8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax8);
  float amax = 0.0f;
  for (float v : lanes) amax = v > amax ? v : amax;
  for (int i = full8; i < n_real; ++i) {
    const float v = __builtin_fabsf(load1_f32(src, src_dtype, i));
    amax = v > amax ? v : amax;
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *scale = amax / 127.0f;
  const __m256 inv8 = _mm256_set1_ps(inv);
  const __m256i invalid = _mm256_set1_epi32(INT32_MIN);  // cvtps2dq's answer to NaN and infinity
  const int full32 = n_real / 32 * 32;  // whole groups of real values
  for (int g = 0; g < full32; g += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8_f32(src, src_dtype, g + 8 * j), inv8));
      q[j] = _mm256_andnot_si256(_mm256_cmpeq_epi32(v, invalid), v);
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    gsum[g / 32] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
    // packs work within 128-bit lanes: [q0 lo, q1 lo, q0 hi, q1 hi] -> the permute restores order
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g), b);
  }
  for (int g = full32; g < n_pad; g += 32) {  // the last real values and the zero padding
    int32_t sum = 0;
    for (int i = g; i < g + 32; ++i) {
      int8_t d = 0;
      if (i < n_real) {
        const int v = _mm_cvtss_si32(_mm_set_ss(load1_f32(src, src_dtype, i) * inv));
        d = v == INT32_MIN ? 0 : int8_t(v);
      }
      dst[i] = d;
      sum += d;
    }
    gsum[g / 32] = sum;
  }
}

const ktk_ops kOps = {dot_bf16, dot_bf16_f32, dot_int8, dot_int4, read_xor, silu_mul16,
                      quantize_int8};

}  // namespace

extern "C" const ktk_ops* ktk_ops_avx2(void) { return &kOps; }
