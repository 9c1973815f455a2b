// A software stand-in for the AMX tile intrinsics ktk_amx.cpp uses, for testing that translation
// unit's logic (tile shapes, strides, chunking, tails) on CPUs without AMX. Included after
// <immintrin.h> when the unit is built with -DKTK_AMX_EMULATE (tests only; never in the package).
//
// Semantics follow the Intel SDM, palette 1: eight tiles of up to 16 rows x 64 bytes; a tile's
// shape (rows, bytes per row) comes from the last loaded configuration.
//   tileloadd/tilestored t, [base + r * stride]  rows r < rows[t], colsb[t] bytes each
//   tdpbssd  c, a, b   c[m][n] += sum_{k < colsb[a]/4} sum_{i < 4} s8 a[m][4k+i] * s8 b[k][4n+i]
//   tdpbf16ps c, a, b  c[m][n] += sum_{k < colsb[a]/4} sum_{i < 2} bf16 a[m][2k+i] * bf16 b[k][2n+i]
// (m < rows[c], n < colsb[c]/4; rows[b] must equal colsb[a]/4). The bf16 product is summed in fp32
// in the order above, which rounds differently from the hardware: compare with a tolerance.
#ifndef KTK_AMX_EMU_H
#define KTK_AMX_EMU_H

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace ktk_amx_emu {

struct Tiles {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}

inline void check(bool ok) {
  if (!ok) abort();  // a shape the hardware would fault on (#UD/#GP): fail loudly in tests
}

inline void loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  check(c[0] == 1);
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    memcpy(&colsb, c + 16 + 2 * i, 2);
    t.rows[i] = c[48 + i];
    t.colsb[i] = colsb;
    check(t.rows[i] <= 16 && colsb <= 64);
  }
}

inline void release() { tiles() = Tiles(); }

inline void load(int i, const void* base, long stride) {
  Tiles& t = tiles();
  check(t.rows[i] > 0);
  for (int r = 0; r < t.rows[i]; ++r)
    memcpy(t.data[i][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[i]);
}

inline void store(int i, void* base, long stride) {
  Tiles& t = tiles();
  check(t.rows[i] > 0);
  for (int r = 0; r < t.rows[i]; ++r)
    memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[i][r], t.colsb[i]);
}

inline void zero(int i) { memset(tiles().data[i], 0, sizeof(tiles().data[i])); }

inline float bf16(const uint8_t* p) {
  uint32_t bits = uint32_t(p[0] | (p[1] << 8)) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// c[m][n] += sum over k < colsb[a]/4 and the kPer elements of 4 bytes: product(a[m] + 4k + i *
// 4/kPer, b[k] + 4n + i * 4/kPer), accumulated in Acc (int32 for tdpbssd, fp32 for tdpbf16ps).
template <int kPer, typename Acc, typename Product>
void dot_product(int c, int a, int b, Product product) {
  Tiles& t = tiles();
  const int K = t.colsb[a] / 4, N = t.colsb[c] / 4;
  check(t.rows[b] == K && t.rows[a] == t.rows[c] && t.colsb[b] == t.colsb[c]);
  for (int m = 0; m < t.rows[c]; ++m)
    for (int n = 0; n < N; ++n) {
      Acc acc;
      memcpy(&acc, t.data[c][m] + 4 * n, 4);
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < kPer; ++i)
          acc += product(t.data[a][m] + 4 * k + i * (4 / kPer), t.data[b][k] + 4 * n + i * (4 / kPer));
      memcpy(t.data[c][m] + 4 * n, &acc, 4);
    }
}

inline void dpbssd(int c, int a, int b) {
  dot_product<4, int32_t>(c, a, b, [](const uint8_t* x, const uint8_t* y) {
    return int32_t(int8_t(*x)) * int32_t(int8_t(*y));
  });
}

inline void dpbf16ps(int c, int a, int b) {
  dot_product<2, float>(c, a, b, [](const uint8_t* x, const uint8_t* y) { return bf16(x) * bf16(y); });
}

}  // namespace ktk_amx_emu

#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ktk_amx_emu::loadconfig(config)
#define _tile_release() ktk_amx_emu::release()
#define _tile_loadd(t, base, stride) ktk_amx_emu::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ktk_amx_emu::load(t, base, stride)
#define _tile_stored(t, base, stride) ktk_amx_emu::store(t, base, stride)
#define _tile_zero(t) ktk_amx_emu::zero(t)
#define _tile_dpbssd(c, a, b) ktk_amx_emu::dpbssd(c, a, b)
#define _tile_dpbf16ps(c, a, b) ktk_amx_emu::dpbf16ps(c, a, b)

#endif
