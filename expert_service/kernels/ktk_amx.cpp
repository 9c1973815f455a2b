// AMX micro kernels (AMX-BF16 for bf16 weights with bf16 activations, AMX-INT8 for int8 and int4
// weights with int8 activations). The packed blocks are already in B-tile order, so a weight block
// of 16 rows is streamed by tileloadd with a 64-byte stride. Small M (decode) and fp32
// activations (the exact mode) go to the AVX-512 kernels.
//
// NOTE: A tiles always load 16 activation rows and C tiles store 16 output rows; the caller pads
// its activation and output buffers by 16 rows so rows past M are readable/writable scratch.
// Internal linkage only (see ktk_avx2.cpp for why).
#include <immintrin.h>

#include "ktk.h"
#ifdef KTK_AMX_EMULATE
#include "ktk_amx_emu.h"
#endif

namespace {

constexpr int kMinM = 8;  // below this, the AVX-512 kernels are faster

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Weights stream from DRAM: ask for the B tile this far ahead (past a block's end, that is the
// next block of the same thread's contiguous range).
constexpr int kPrefetchBytes = 8192;

inline void prefetch_tile(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < 1024; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Tiles 0-3: C (16 x 16 fp32/int32); 4, 5: B (b_rows x 64 bytes); 6, 7: A (16 x a_colsb bytes).
void configure(int b_rows, int a_colsb) {
  TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = uint8_t(b_rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = uint16_t(a_colsb);
  }
  _tile_loadconfig(&cfg);
}

template <int NC>
void bf16_pass(const uint16_t* w, int K, const uint16_t* x, int ldx, float* out) {
  if (NC > 0) _tile_zero(0);
  if (NC > 1) _tile_zero(1);
  if (NC > 2) _tile_zero(2);
  if (NC > 3) _tile_zero(3);
  const long sx = long(ldx) * 2;
  for (int k = 0; k < K; k += 32) {
    prefetch_tile(w + k * 16 + kPrefetchBytes / 2);
    _tile_loadd(4, w + k * 16, 64);
    _tile_loadd(6, x + k, sx);
    _tile_dpbf16ps(0, 6, 4);
    if (NC > 1) {
      _tile_loadd(7, x + size_t(16) * ldx + k, sx);
      _tile_dpbf16ps(1, 7, 4);
    }
    if (NC > 2) {
      _tile_loadd(6, x + size_t(32) * ldx + k, sx);
      _tile_dpbf16ps(2, 6, 4);
    }
    if (NC > 3) {
      _tile_loadd(7, x + size_t(48) * ldx + k, sx);
      _tile_dpbf16ps(3, 7, 4);
    }
  }
  _tile_stored(0, out, 64);
  if (NC > 1) _tile_stored(1, out + 256, 64);
  if (NC > 2) _tile_stored(2, out + 512, 64);
  if (NC > 3) _tile_stored(3, out + 768, 64);
}

void dot_bf16(const uint16_t* w, int K, const uint16_t* x, int ldx, int M, float* out) {
  if (M < kMinM) return ktk_ops_avx512()->dot_bf16(w, K, x, ldx, M, out);
  configure(16, 64);
  for (int m = 0; m < M; m += 64) {
    int nc = (M - m + 15) / 16;
    const uint16_t* xm = x + size_t(m) * ldx;
    if (nc >= 4)
      bf16_pass<4>(w, K, xm, ldx, out + m * 16);
    else if (nc == 3)
      bf16_pass<3>(w, K, xm, ldx, out + m * 16);
    else if (nc == 2)
      bf16_pass<2>(w, K, xm, ldx, out + m * 16);
    else
      bf16_pass<1>(w, K, xm, ldx, out + m * 16);
  }
  _tile_release();
}

template <int NC>
void int8_pass(const int8_t* w, int K, const int8_t* x, int ldx, int32_t* c) {
  if (NC > 0) _tile_zero(0);
  if (NC > 1) _tile_zero(1);
  if (NC > 2) _tile_zero(2);
  if (NC > 3) _tile_zero(3);
  for (int k = 0; k < K; k += 64) {
    prefetch_tile(w + k * 16 + kPrefetchBytes);
    _tile_loadd(4, w + k * 16, 64);
    _tile_loadd(6, x + k, ldx);
    _tile_dpbssd(0, 6, 4);
    if (NC > 1) {
      _tile_loadd(7, x + size_t(16) * ldx + k, ldx);
      _tile_dpbssd(1, 7, 4);
    }
    if (NC > 2) {
      _tile_loadd(6, x + size_t(32) * ldx + k, ldx);
      _tile_dpbssd(2, 6, 4);
    }
    if (NC > 3) {
      _tile_loadd(7, x + size_t(48) * ldx + k, ldx);
      _tile_dpbssd(3, 7, 4);
    }
  }
  _tile_stored(0, c, 64);
  if (NC > 1) _tile_stored(1, c + 256, 64);
  if (NC > 2) _tile_stored(2, c + 512, 64);
  if (NC > 3) _tile_stored(3, c + 768, 64);
}

void dot_int8(const int8_t* w, const float* ws, const int32_t* wsum, int K, const int8_t* x,
              int ldx, const float* xs, int M, float* out) {
  if (M < kMinM) return ktk_ops_avx512()->dot_int8(w, ws, wsum, K, x, ldx, xs, M, out);
  alignas(64) int32_t c[64 * 16];
  const __m512 s = _mm512_loadu_ps(ws);
  configure(16, 64);
  for (int m = 0; m < M; m += 64) {
    int nc = (M - m + 15) / 16;
    const int8_t* xm = x + size_t(m) * ldx;
    if (nc >= 4)
      int8_pass<4>(w, K, xm, ldx, c);
    else if (nc == 3)
      int8_pass<3>(w, K, xm, ldx, c);
    else if (nc == 2)
      int8_pass<2>(w, K, xm, ldx, c);
    else
      int8_pass<1>(w, K, xm, ldx, c);
    int rows = M - m < 64 ? M - m : 64;
    for (int i = 0; i < rows; ++i) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * 16));
      _mm512_storeu_ps(out + (m + i) * 16, _mm512_mul_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(xs[m + i]))));
    }
  }
  _tile_release();
}

// Unpacks one group (256 bytes of nibbles) to the int8 B tile [8 quads][16 rows][4] of 16 * w:
// each nibble (w + 8) with its top bit flipped is w in 4-bit two's complement, so moved to the top
// of its byte it reads as int8 16 * w ([-128, 112]). The factor 16 leaves the tile sums exact
// (|C| <= 32 * 128 * 128) and comes out with the token scale (a power of two: the result is
// bit for bit what w itself gives).
inline void unpack_group16(const uint8_t* wg, int8_t* bq) {
  const __m512i flip = _mm512_set1_epi8(char(0x80)), top = _mm512_set1_epi8(char(0xf0));
  for (int c = 0; c < 4; ++c) {
    __m512i v = _mm512_loadu_si512(wg + c * 64);
    // (a ^ b) & c: ternary-logic table 0x28 (a = 0xf0, b = 0xcc, c = 0xaa)
    __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 4), flip, top, 0x28);
    __m512i hi = _mm512_ternarylogic_epi32(v, flip, top, 0x28);
    _mm512_store_si512(bq + c * 64, lo);
    _mm512_store_si512(bq + (c + 4) * 64, hi);
  }
}
constexpr float kUnpackScale = 1.0f / 16;

inline __m512 group_scales(const uint16_t* gs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gs))), 16));
}

// A pass over up to 16 * NC tokens goes in steps of two tile products, each a group of 32 weights
// by 16 tokens: NC == 1: groups g, g + 1; NC == 2: group g by tokens 0-15 and 16-31. A step's C
// tiles are flushed to fp32 (acc += C * scale on AVX-512: the group scales differ per output row)
// kInt4FlushLag steps later, after the next steps' tile work is issued, and consecutive steps use
// C tiles 0, 1 and 2, 3, so the tile unit computes while the vector unit flushes earlier steps.
// Tiles: C 0-3, B 4-5, A 6-7 (configure(8, 32)). kInt4FlushLag: how many steps behind.
constexpr int kInt4FlushLag = 2;
// GCC pastes tile numbers into the instruction text, so they must be literals: one body per pair
// of C tiles (CA, CB), for int4_step_tiles below.
#define KTK_INT4_STEP_PRODUCTS(CA, CB)                  \
  _tile_zero(CA);                                       \
  _tile_zero(CB);                                       \
  _tile_loadd(4, bq, 64);                               \
  _tile_loadd(6, xg, ldx);                              \
  _tile_dpbssd(CA, 6, 4);                               \
  if (NC == 1) {                                        \
    _tile_loadd(5, bq + 512, 64);                       \
    _tile_loadd(7, xg + 32, ldx);                       \
    _tile_dpbssd(CB, 7, 5);                             \
  } else {                                              \
    _tile_loadd(7, xg + size_t(16) * ldx, ldx);         \
    _tile_dpbssd(CB, 7, 4);                             \
  }                                                     \
  _tile_stored(CA, c[0], 64);                           \
  _tile_stored(CB, c[1], 64);

// One step's tile work into C tiles 2 * SET and 2 * SET + 1, stored to c[0], c[1]: wg, the
// step's first group of nibbles; xg, the activations of that group (bq: its B tiles).
template <int NC, int SET>
inline void int4_step_tiles(const uint8_t* wg, const int8_t* xg, int ldx, int8_t* bq,
                            int32_t (*c)[256]) {
  // Nibbles: the same byte distance ahead as the other passes.
  const char* wpf = reinterpret_cast<const char*>(wg) + kPrefetchBytes;
  for (int i = 0; i < 256 * (3 - NC); i += 64) _mm_prefetch(wpf + i, _MM_HINT_T0);
  unpack_group16(wg, bq);
  if (NC == 1) unpack_group16(wg + 256, bq + 512);
  // The tile-load intrinsic does not tell the compiler it reads bq: this empty asm does.
  __asm__ volatile("" ::"m"(*reinterpret_cast<const int8_t(*)[1024]>(bq)));
  // Nor that the tile stores overwrite c: reads of c before this stay before them.
  __asm__ volatile("" : "+m"(c[0]), "+m"(c[1]));
  if constexpr (SET == 0) {
    KTK_INT4_STEP_PRODUCTS(0, 1)
  } else {
    KTK_INT4_STEP_PRODUCTS(2, 3)
  }
  // ... and keeps the next unpack into bq behind the tile loads.
  __asm__ volatile("" : "+m"(*reinterpret_cast<int8_t(*)[1024]>(bq)));
}
#undef KTK_INT4_STEP_PRODUCTS

// acc += the step's C tiles (stored to c[0], c[1]) times their group scales; scales (1/8 of the
// weight bytes, one 64-byte line per two groups) are fetched the nibbles' distance ahead in groups.
template <int NC>
inline void int4_step_flush(const uint16_t* gs, int g, int32_t (*c)[256], __m512* acc) {
  // Nor does the tile store tell it that it wrote c: this does.
  __asm__ volatile("" : "+m"(c[0]), "+m"(c[1]));
  if (!(g & 1)) _mm_prefetch(reinterpret_cast<const char*>(gs + g * 16) + kPrefetchBytes / 8, _MM_HINT_T0);
  const __m512 s0 = group_scales(gs + g * 16);
  if (NC == 1) {
    const __m512 s1 = group_scales(gs + (g + 1) * 16);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0] + i * 16)), s0, acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1] + i * 16)), s1, acc[i]);
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0] + i * 16)), s0, acc[i]);
      acc[16 + i] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1] + i * 16)), s0, acc[16 + i]);
    }
  }
}

// nb consecutive blocks in one pipeline: the steps run on across block boundaries (a block's groups
// follow the previous block's in memory, so the nibbles and scales of step s are at group
// s * per_step overall; the activations at that group within the block), and the flush of a
// block's last step writes its result and clears acc, while the next block's first steps are
// already in the tile unit.
template <int NC>
void int4_pass(const uint8_t* w, const uint16_t* gs, int K, int nb, const int8_t* x, int ldx,
               const float* xs, int rows, float* out, size_t ldo) {
  alignas(64) int8_t bq[2][1024];                    // [step parity][B tiles]
  alignas(64) int32_t c[kInt4FlushLag + 1][2][256];  // [step % (lag + 1)][C tile][16 x 16]
  __m512 acc[NC * 16];
#pragma GCC unroll 32
  for (int i = 0; i < NC * 16; ++i) acc[i] = _mm512_setzero_ps();
  const int per_step = 3 - NC;  // groups
  const int block_steps = K / 32 / per_step, steps = nb * block_steps;
  // ring: s % (lag + 1); local: s's step within its block
  for (int s = 0, ring = 0, local = 0; s < steps + kInt4FlushLag;
       ++s, ring = ring == kInt4FlushLag ? 0 : ring + 1,
           local = local + 1 == block_steps ? 0 : local + 1) {
    if (s < steps) {
      const uint8_t* wg = w + size_t(s) * per_step * 256;
      const int8_t* xg = x + local * per_step * 32;
      if (s & 1)
        int4_step_tiles<NC, 1>(wg, xg, ldx, bq[1], c[ring]);
      else
        int4_step_tiles<NC, 0>(wg, xg, ldx, bq[0], c[ring]);
    }
    const int f = s - kInt4FlushLag;  // the step flushed now
    if (f < 0) continue;
    const int back = ring >= kInt4FlushLag ? ring - kInt4FlushLag : ring + 1;  // f % (lag + 1)
    int4_step_flush<NC>(gs, f * per_step, c[back], acc);
    if ((f + 1) % block_steps) continue;
    float* ob = out + size_t(f / block_steps) * ldo;
    // Constant indices (the loops unrolled) keep acc in registers.
#pragma GCC unroll 32
    for (int i = 0; i < NC * 16; ++i) {
      if (i < rows)
        _mm512_storeu_ps(ob + i * 16, _mm512_mul_ps(acc[i], _mm512_set1_ps(xs[i] * kUnpackScale)));
      acc[i] = _mm512_setzero_ps();
    }
  }
}

// Rows past the last full 16-row chunk go to AVX-512 VNNI when they are at most this many: a tile
// chunk costs about as much for 1 row as for 16, and VNNI does 8 rows in ~2/3 of a chunk's time
// (GPU host, T=512, 15 threads: DeepSeek-V3 2.58 vs 2.48 TOPS, Qwen3 2.35 vs 2.19; 4 measured the
// same as 8).
constexpr int kInt4VnniTail = 8;

void dot_int4(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
              const float* xs, const int32_t* xg, int ldg, int M, int nb, float* out, size_t ldo) {
  const int tail = M % 16 <= kInt4VnniTail ? M % 16 : 0;
  const int tiled = M - tail;
  if (tiled < kMinM)
    return ktk_ops_avx512()->dot_int4(w, gs, K, x, ldx, xs, xg, ldg, M, nb, out, ldo);
  configure(8, 32);
  for (int m = 0; m < tiled; m += 32) {
    int rows = tiled - m < 32 ? tiled - m : 32;
    const int8_t* xm = x + size_t(m) * ldx;
    if (rows > 16)
      int4_pass<2>(w, gs, K, nb, xm, ldx, xs + m, rows, out + m * 16, ldo);
    else
      int4_pass<1>(w, gs, K, nb, xm, ldx, xs + m, rows, out + m * 16, ldo);
  }
  _tile_release();
  if (tail)
    ktk_ops_avx512()->dot_int4(w, gs, K, x + size_t(tiled) * ldx, ldx, xs + tiled,
                               xg + size_t(tiled) * ldg, ldg, tail, nb, out + tiled * 16, ldo);
}

// fp32 activations (the exact mode): AMX-BF16 multiplies bf16 A tiles only, so this is the AVX-512
// code itself (the same function the avx512 ISA runs and the tests check), for every M.
void dot_bf16_f32(const uint16_t* w, int K, const float* x, int ldx, int M, float* out) {
  ktk_ops_avx512()->dot_bf16_f32(w, K, x, ldx, M, out);
}

uint64_t read_xor(const void* p, size_t bytes) { return ktk_ops_avx512()->read_xor(p, bytes); }

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

extern "C" const ktk_ops* ktk_ops_amx(void) { return &kOps; }
