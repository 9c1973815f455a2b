// AVX-512 (F/BW/VL + BF16 + VNNI) micro kernels: one zmm holds the 16 rows of a block, so every
// 64-byte weight vector feeds one vdpbf16ps / vpdpbusd per token. Internal linkage only (see
// ktk_avx2.cpp for why).
#include <immintrin.h>

#include "ktk.h"

#ifndef KTK_INT4_PREFETCH
#define KTK_INT4_PREFETCH 4096
#endif

namespace {

inline __m512i bcast32(const void* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

template <int MT>
void dot_bf16_tile(const uint16_t* w, int K, const uint16_t* x, int ldx, float* out) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * 32);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)bcast32(x + size_t(m) * ldx + 2 * p));
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}

// One token: four accumulators over k break the vdpbf16ps latency chain.
void dot_bf16_one(const uint16_t* w, int K, const uint16_t* x, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int p = 0; p < K / 2; p += 4) {
    const uint16_t* wp = w + p * 32;
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wp), (__m512bh)bcast32(x + 2 * p));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wp + 32), (__m512bh)bcast32(x + 2 * p + 2));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wp + 64), (__m512bh)bcast32(x + 2 * p + 4));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wp + 96), (__m512bh)bcast32(x + 2 * p + 6));
  }
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

void dot_bf16(const uint16_t* w, int K, const uint16_t* x, int ldx, int M, float* out) {
  if (M == 1) return dot_bf16_one(w, K, x, out);
  int m = 0;
  for (; m + 8 <= M; m += 8) dot_bf16_tile<8>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 4 <= M; m += 4) dot_bf16_tile<4>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 2 <= M; m += 2) dot_bf16_tile<2>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m < M; ++m) dot_bf16_tile<1>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
}

// bf16 weights, fp32 activations (the exact mode): one 64-byte vector holds the pair (2p, 2p+1) of
// the 16 rows as 32-bit lanes [w(2p) | w(2p+1) << 16]; a left shift by 16 widens the even element
// to fp32, masking the low half widens the odd one (both exact), then fp32 FMA. Even and odd k
// accumulate in separate chains.
inline __m512 widen_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 widen_odd(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

template <int MT>
void dot_f32x_tile(const uint16_t* w, int K, const float* x, int ldx, float* out) {
  __m512 ev[MT], od[MT];
  for (int m = 0; m < MT; ++m) ev[m] = od[m] = _mm512_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    __m512i v = _mm512_loadu_si512(w + p * 32);
    __m512 we = widen_even(v), wo = widen_odd(v);
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + size_t(m) * ldx + 2 * p;
      ev[m] = _mm512_fmadd_ps(we, _mm512_set1_ps(xm[0]), ev[m]);
      od[m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xm[1]), od[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * 16, _mm512_add_ps(ev[m], od[m]));
}

// One token: eight chains (4 pairs x even/odd) hide the FMA latency; K/2 is a multiple of 32.
void dot_f32x_one(const uint16_t* w, int K, const float* x, float* out) {
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  for (int p = 0; p < K / 2; p += 4) {
    const uint16_t* wp = w + p * 32;
    const float* xp = x + 2 * p;
    __m512i v0 = _mm512_loadu_si512(wp), v1 = _mm512_loadu_si512(wp + 32);
    __m512i v2 = _mm512_loadu_si512(wp + 64), v3 = _mm512_loadu_si512(wp + 96);
    e0 = _mm512_fmadd_ps(widen_even(v0), _mm512_set1_ps(xp[0]), e0);
    o0 = _mm512_fmadd_ps(widen_odd(v0), _mm512_set1_ps(xp[1]), o0);
    e1 = _mm512_fmadd_ps(widen_even(v1), _mm512_set1_ps(xp[2]), e1);
    o1 = _mm512_fmadd_ps(widen_odd(v1), _mm512_set1_ps(xp[3]), o1);
    e2 = _mm512_fmadd_ps(widen_even(v2), _mm512_set1_ps(xp[4]), e2);
    o2 = _mm512_fmadd_ps(widen_odd(v2), _mm512_set1_ps(xp[5]), o2);
    e3 = _mm512_fmadd_ps(widen_even(v3), _mm512_set1_ps(xp[6]), e3);
    o3 = _mm512_fmadd_ps(widen_odd(v3), _mm512_set1_ps(xp[7]), o3);
  }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(e0, o0), _mm512_add_ps(e1, o1)),
                           _mm512_add_ps(_mm512_add_ps(e2, o2), _mm512_add_ps(e3, o3)));
  _mm512_storeu_ps(out, s);
}

// Many tokens: the block (16 rows x K) is streamed from memory once; each chunk of up to 8 tokens
// walks it again from cache (a blocked fp32 GEMM over the expert's grouped tokens).
void dot_bf16_f32(const uint16_t* w, int K, const float* x, int ldx, int M, float* out) {
  if (M == 1) return dot_f32x_one(w, K, x, out);
  int m = 0;
  for (; m + 8 <= M; m += 8) dot_f32x_tile<8>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 4 <= M; m += 4) dot_f32x_tile<4>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m + 2 <= M; m += 2) dot_f32x_tile<2>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
  for (; m < M; ++m) dot_f32x_tile<1>(w, K, x + size_t(m) * ldx, ldx, out + m * 16);
}

// int8: vpdpbusd(u8 x, s8 w) with x + 128 as the unsigned operand; minus 128 * rowsum(w).
template <int MT>
void dot_int8_tile(const int8_t* w, const float* ws, const int32_t* wsum, int K, const int8_t* x,
                   int ldx, const float* xs, float* out) {
  const __m512i flip = _mm512_set1_epi32(int(0x80808080u));
  __m512i acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_si512();
  for (int q = 0; q < K / 4; ++q) {
    __m512i wv = _mm512_loadu_si512(w + q * 64);
    for (int m = 0; m < MT; ++m) {
      __m512i xb = _mm512_xor_si512(bcast32(x + size_t(m) * ldx + 4 * q), flip);
      acc[m] = _mm512_dpbusd_epi32(acc[m], xb, wv);
    }
  }
  __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
  __m512 s = _mm512_loadu_ps(ws);
  for (int m = 0; m < MT; ++m) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m], corr));
    _mm512_storeu_ps(out + m * 16, _mm512_mul_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(xs[m]))));
  }
}

void dot_int8_one(const int8_t* w, const float* ws, const int32_t* wsum, int K, const int8_t* x,
                  const float* xs, float* out) {
  const __m512i flip = _mm512_set1_epi32(int(0x80808080u));
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int q = 0; q < K / 4; q += 4) {
    const int8_t* wq = w + q * 64;
    a0 = _mm512_dpbusd_epi32(a0, _mm512_xor_si512(bcast32(x + 4 * q), flip), _mm512_loadu_si512(wq));
    a1 = _mm512_dpbusd_epi32(a1, _mm512_xor_si512(bcast32(x + 4 * q + 4), flip),
                             _mm512_loadu_si512(wq + 64));
    a2 = _mm512_dpbusd_epi32(a2, _mm512_xor_si512(bcast32(x + 4 * q + 8), flip),
                             _mm512_loadu_si512(wq + 128));
    a3 = _mm512_dpbusd_epi32(a3, _mm512_xor_si512(bcast32(x + 4 * q + 12), flip),
                             _mm512_loadu_si512(wq + 192));
  }
  __m512i acc = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
  acc = _mm512_sub_epi32(acc, _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7));
  __m512 s = _mm512_mul_ps(_mm512_loadu_ps(ws), _mm512_set1_ps(xs[0]));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(acc), s));
}

void dot_int8(const int8_t* w, const float* ws, const int32_t* wsum, int K, const int8_t* x,
              int ldx, const float* xs, int M, float* out) {
  if (M == 1) return dot_int8_one(w, ws, wsum, K, x, xs, out);
  int m = 0;
  for (; m + 8 <= M; m += 8)
    dot_int8_tile<8>(w, ws, wsum, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
  for (; m + 4 <= M; m += 4)
    dot_int8_tile<4>(w, ws, wsum, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
  for (; m + 2 <= M; m += 2)
    dot_int8_tile<2>(w, ws, wsum, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
  for (; m < M; ++m) dot_int8_tile<1>(w, ws, wsum, K, x + size_t(m) * ldx, ldx, xs + m, out + m * 16);
}

// bf16 scales of one group (16 rows) widened to fp32.
inline __m512 group_scale(const uint16_t* gs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gs))), 16));
}

// Decode streams weights from DRAM: ask for them this far ahead (past a block's end, that is the
// next block of the thread's contiguous range); the scales (1/8 of the weight bytes) likewise.
constexpr int kPrefetchBytes = KTK_INT4_PREFETCH;

// One group of one token, as 16 x the integer dot product minus 128 * sum(x) (the +8 offset):
// the low nibbles (v & 0x0f) and the high nibbles left in place (v & 0xf0, i.e. 16 x the value,
// still a valid unsigned byte) feed separate vpdpbusd chains, so unpacking costs one AND per
// nibble; lo * 16 + hi is exact in int32 (|.| < 2^21).
inline __m512i group16_one(const uint8_t* wg, const int8_t* xm, int32_t xg) {
  const __m512i lom = _mm512_set1_epi8(0x0f), him = _mm512_set1_epi8(int8_t(0xf0));
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_set1_epi32(-128 * xg);
  for (int c = 0; c < 4; ++c) {
    __m512i v = _mm512_loadu_si512(wg + c * 64);
    lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, lom), bcast32(xm + 4 * c));
    hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(v, him), bcast32(xm + 4 * (c + 4)));
  }
  return _mm512_add_epi32(_mm512_slli_epi32(lo, 4), hi);
}

// int4, several tokens: the nibbles of each 64-byte vector are unpacked once (as in group16_one)
// and feed every token's two chains; per group: (lo * 16 + hi - 128 * sum(x)) * scale / 16.
template <int MT>
void dot_int4_tile(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
                   const float* xs, const int32_t* xg, int ldg, float* out) {
  const __m512i lom = _mm512_set1_epi8(0x0f), him = _mm512_set1_epi8(int8_t(0xf0));
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int g = 0; g < K / 32; ++g) {
    const uint8_t* wg = w + g * 256;
    if (kPrefetchBytes > 0) {
      for (int i = 0; i < 256; i += 64) _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchBytes + i, _MM_HINT_T0);
      if (!(g & 1)) _mm_prefetch(reinterpret_cast<const char*>(gs + g * 16) + kPrefetchBytes / 8, _MM_HINT_T0);
    }
    __m512i lo[MT], hi[MT];
    for (int m = 0; m < MT; ++m) {
      lo[m] = _mm512_setzero_si512();
      hi[m] = _mm512_set1_epi32(-128 * xg[size_t(m) * ldg + g]);
    }
    for (int c = 0; c < 4; ++c) {
      __m512i v = _mm512_loadu_si512(wg + c * 64);
      __m512i vl = _mm512_and_si512(v, lom), vh = _mm512_and_si512(v, him);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xm = x + size_t(m) * ldx + g * 32;
        lo[m] = _mm512_dpbusd_epi32(lo[m], vl, bcast32(xm + 4 * c));
        hi[m] = _mm512_dpbusd_epi32(hi[m], vh, bcast32(xm + 4 * (c + 4)));
      }
    }
    __m512 sc = group_scale(gs + g * 16);
    for (int m = 0; m < MT; ++m) {
      __m512i ia = _mm512_add_epi32(_mm512_slli_epi32(lo[m], 4), hi[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sc, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    _mm512_storeu_ps(out + m * 16, _mm512_mul_ps(acc[m], _mm512_set1_ps(xs[m] * 0.0625f)));
}

// One token: two groups per step (four independent vpdpbusd chains, two fp32 accumulators); the
// factor 16 of group16_one is folded into the final scale (exact: a power of two).
void dot_int4_one(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, const float* xs,
                  const int32_t* xg, float* out) {
  __m512 f0 = _mm512_setzero_ps(), f1 = f0;
  for (int g = 0; g < K / 32; g += 2) {  // K is a multiple of 64
    const uint8_t* wg = w + g * 256;
    if (kPrefetchBytes > 0) {
      for (int i = 0; i < 512; i += 64) _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchBytes + i, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(gs + g * 16) + kPrefetchBytes / 8, _MM_HINT_T0);
    }
    __m512i i0 = group16_one(wg, x + g * 32, xg[g]);
    __m512i i1 = group16_one(wg + 256, x + g * 32 + 32, xg[g + 1]);
    f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), group_scale(gs + g * 16), f0);
    f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), group_scale(gs + g * 16 + 16), f1);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_add_ps(f0, f1), _mm512_set1_ps(xs[0] * 0.0625f)));
}

void dot_int4_block(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
                    const float* xs, const int32_t* xg, int ldg, int M, float* out) {
  if (M == 1) return dot_int4_one(w, gs, K, x, xs, xg, out);
  int m = 0;
  for (; m + 8 <= M; m += 8)
    dot_int4_tile<8>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg, out + m * 16);
  for (; m + 4 <= M; m += 4)
    dot_int4_tile<4>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg, out + m * 16);
  for (; m + 2 <= M; m += 2)
    dot_int4_tile<2>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg, out + m * 16);
  for (; m < M; ++m)
    dot_int4_tile<1>(w, gs, K, x + size_t(m) * ldx, ldx, xs + m, xg + size_t(m) * ldg, ldg, out + m * 16);
}

void dot_int4(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
              const float* xs, const int32_t* xg, int ldg, int M, int nb, float* out, size_t ldo) {
  for (int b = 0; b < nb; ++b)
    dot_int4_block(w + b * ktk_int4_block_bytes(K), gs + b * ktk_int4_block_scales(K), K, x, ldx,
                   xs, xg, ldg, M, out + b * ldo);
}

uint64_t read_xor(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(c + i + 0));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(c + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(c + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(c + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t r = 0;
  for (uint64_t v : lanes) r ^= v;
  return r;
}

void silu_mul16(const float* gate, const float* up, int rows, float* h, int ldh) {
  ktk_ops_avx2()->silu_mul16(gate, up, rows, h, ldh);
}

void quantize_int8(const void* src, int src_dtype, int n_real, int n_pad, int8_t* dst,
                   float* scale, int32_t* gsum) {
  ktk_ops_avx2()->quantize_int8(src, src_dtype, n_real, n_pad, dst, scale, gsum);
}

const ktk_ops kOps = {dot_bf16, dot_bf16_f32, dot_int8, dot_int4, read_xor, silu_mul16,
                      quantize_int8};

}  // namespace

extern "C" const ktk_ops* ktk_ops_avx512(void) { return &kOps; }
