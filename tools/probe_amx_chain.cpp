// How the AMX unit orders its work (GPU host: needs AMX), measured with short
// instruction sequences repeated on data in L1, one thread, ns per iteration. The int4 pass's step
// (ktk_amx.cpp) is built from these parts; which of them chain (wait on the one before) and which
// overlap decides how a step should use the eight tile registers:
//   dp chain / dp x4           one product into the same C, or into four C tiles in turn
//   load+dp, one B / two B     a B tile load then a product reading it, with the next load into
//                              the same B register or alternating two (C tiles in turn)
//   load                       B tile loads alone
//   lane, one set / two sets   zero C, load A and B, product, store C: with the same tiles each
//                              time, or two sets of tiles in turn, or C over four with two A and B
//   vstore->load near / far    a B tile written by vector stores, then loaded: the one just
//                              written, or the one written four iterations before
//   tstore->vload near / far   a C tile stored, then read back by vector loads: just now, or the
//                              one stored four iterations before
// Half: the int4 shapes (B 8 rows, A 32 bytes: K = 32); full: int8's (B 16 rows, A 64: K = 64).
//   build: g++ -O2 -std=c++17 -mavx512f -mamx-tile -mamx-int8 -o /tmp/probe_amx_chain tools/probe_amx_chain.cpp
//   usage: /tmp/probe_amx_chain [iterations (20000)] [rounds (5)]
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure(int b_rows, int a_colsb) {
  TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = uint8_t(b_rows), cfg.colsb[t] = 64;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = uint16_t(a_colsb);
  _tile_loadconfig(&cfg);
}

alignas(64) int8_t g_a[2][1024], g_b[8][1024];
alignas(64) int32_t g_c[8][256];

// Each sequence runs n iterations (a multiple of 4).
void dp_chain(int n) {
  for (int i = 0; i < n; ++i) _tile_dpbssd(0, 6, 4);
}
void dp_x4(int n) {
  for (int i = 0; i < n; i += 4) {
    _tile_dpbssd(0, 6, 4);
    _tile_dpbssd(1, 6, 4);
    _tile_dpbssd(2, 6, 4);
    _tile_dpbssd(3, 6, 4);
  }
}
void load_dp_one_b(int n) {
  for (int i = 0; i < n; i += 4) {
    _tile_loadd(4, g_b[0], 64);
    _tile_dpbssd(0, 6, 4);
    _tile_loadd(4, g_b[1], 64);
    _tile_dpbssd(1, 6, 4);
    _tile_loadd(4, g_b[2], 64);
    _tile_dpbssd(2, 6, 4);
    _tile_loadd(4, g_b[3], 64);
    _tile_dpbssd(3, 6, 4);
  }
}
void load_dp_two_b(int n) {
  for (int i = 0; i < n; i += 4) {
    _tile_loadd(4, g_b[0], 64);
    _tile_dpbssd(0, 6, 4);
    _tile_loadd(5, g_b[1], 64);
    _tile_dpbssd(1, 6, 5);
    _tile_loadd(4, g_b[2], 64);
    _tile_dpbssd(2, 6, 4);
    _tile_loadd(5, g_b[3], 64);
    _tile_dpbssd(3, 6, 5);
  }
}
void load_only(int n) {
  for (int i = 0; i < n; i += 4) {
    _tile_loadd(4, g_b[0], 64);
    _tile_loadd(5, g_b[1], 64);
    _tile_loadd(4, g_b[2], 64);
    _tile_loadd(5, g_b[3], 64);
  }
}
#define LANE(C, A, B, I)              \
  _tile_zero(C);                      \
  _tile_loadd(A, g_a[(I) & 1], 64);   \
  _tile_loadd(B, g_b[(I) & 7], 64);   \
  _tile_dpbssd(C, A, B);              \
  _tile_stored(C, g_c[(I) & 7], 64);
void lane_one_set(int n) {
  for (int i = 0; i < n; i += 4) {
    LANE(0, 6, 4, 0) LANE(0, 6, 4, 1) LANE(0, 6, 4, 2) LANE(0, 6, 4, 3)
  }
}
void lane_two_sets(int n) {
  for (int i = 0; i < n; i += 4) {
    LANE(0, 6, 4, 0) LANE(1, 7, 5, 1) LANE(0, 6, 4, 2) LANE(1, 7, 5, 3)
  }
}
void lane_four_c(int n) {
  for (int i = 0; i < n; i += 4) {
    LANE(0, 6, 4, 0) LANE(1, 7, 5, 1) LANE(2, 6, 4, 2) LANE(3, 7, 5, 3)
  }
}
#undef LANE
// 512 bytes (a half B tile) of vector stores into g_b[w], then the tile product from g_b[r].
inline void vstore(int w, int i) {
  const __m512i v = _mm512_set1_epi32(i);
  for (int k = 0; k < 512; k += 64) _mm512_store_si512(g_b[w] + k, v);
}
void vstore_load_near(int n) {
  for (int i = 0; i < n; i += 4) {
    vstore(0, i); _tile_loadd(4, g_b[0], 64); _tile_dpbssd(0, 6, 4);
    vstore(1, i); _tile_loadd(5, g_b[1], 64); _tile_dpbssd(1, 6, 5);
    vstore(2, i); _tile_loadd(4, g_b[2], 64); _tile_dpbssd(2, 6, 4);
    vstore(3, i); _tile_loadd(5, g_b[3], 64); _tile_dpbssd(3, 6, 5);
  }
}
void vstore_load_far(int n) {
  for (int i = 0; i < n; i += 4) {
    vstore(0, i); _tile_loadd(4, g_b[4], 64); _tile_dpbssd(0, 6, 4);
    vstore(1, i); _tile_loadd(5, g_b[5], 64); _tile_dpbssd(1, 6, 5);
    vstore(2, i); _tile_loadd(4, g_b[6], 64); _tile_dpbssd(2, 6, 4);
    vstore(3, i); _tile_loadd(5, g_b[7], 64); _tile_dpbssd(3, 6, 5);
    vstore(4, i); _tile_loadd(4, g_b[0], 64); _tile_dpbssd(0, 6, 4);
    vstore(5, i); _tile_loadd(5, g_b[1], 64); _tile_dpbssd(1, 6, 5);
    vstore(6, i); _tile_loadd(4, g_b[2], 64); _tile_dpbssd(2, 6, 4);
    vstore(7, i); _tile_loadd(5, g_b[3], 64); _tile_dpbssd(3, 6, 5);
  }
}
__m512 g_sink;
// A C tile's 16 rows read back and summed (the fold's loads and conversions).
inline __m512 vload(int r, __m512 acc) {
  __asm__ volatile("" ::"m"(g_c[r]));
  for (int k = 0; k < 16; ++k)
    acc = _mm512_add_ps(acc, _mm512_cvtepi32_ps(_mm512_load_si512(g_c[r] + k * 16)));
  return acc;
}
void tstore_vload_near(int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 4) {
    _tile_dpbssd(0, 6, 4); _tile_stored(0, g_c[0], 64); acc = vload(0, acc);
    _tile_dpbssd(1, 6, 4); _tile_stored(1, g_c[1], 64); acc = vload(1, acc);
    _tile_dpbssd(2, 6, 4); _tile_stored(2, g_c[2], 64); acc = vload(2, acc);
    _tile_dpbssd(3, 6, 4); _tile_stored(3, g_c[3], 64); acc = vload(3, acc);
  }
  g_sink = acc;
}
void tstore_vload_far(int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    _tile_dpbssd(0, 6, 4); _tile_stored(0, g_c[0], 64); acc = vload(4, acc);
    _tile_dpbssd(1, 6, 4); _tile_stored(1, g_c[1], 64); acc = vload(5, acc);
    _tile_dpbssd(2, 6, 4); _tile_stored(2, g_c[2], 64); acc = vload(6, acc);
    _tile_dpbssd(3, 6, 4); _tile_stored(3, g_c[3], 64); acc = vload(7, acc);
    _tile_dpbssd(0, 6, 4); _tile_stored(0, g_c[4], 64); acc = vload(0, acc);
    _tile_dpbssd(1, 6, 4); _tile_stored(1, g_c[5], 64); acc = vload(1, acc);
    _tile_dpbssd(2, 6, 4); _tile_stored(2, g_c[6], 64); acc = vload(2, acc);
    _tile_dpbssd(3, 6, 4); _tile_stored(3, g_c[7], 64); acc = vload(3, acc);
  }
  g_sink = acc;
}

struct Probe {
  const char* name;
  void (*run)(int);
};

double time_ns(const Probe& p, int n, bool half) {
  configure(half ? 8 : 16, half ? 32 : 64);
  _tile_loadd(6, g_a[0], 64);
  _tile_loadd(7, g_a[1], 64);
  _tile_loadd(4, g_b[0], 64);
  _tile_loadd(5, g_b[1], 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  p.run(n / 8);  // warm
  auto t0 = std::chrono::steady_clock::now();
  p.run(n);
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return ns / n;
}

}  // namespace

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) / 8 * 8 : 20000, rounds = argc > 2 ? atoi(argv[2]) : 5;
  if (n < 8 || rounds < 1) return fprintf(stderr, "usage: probe_amx_chain [iterations] [rounds]\n"), 2;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return fprintf(stderr, "AMX not permitted on this machine\n"), 1;
  for (int i = 0; i < 1024; ++i)
    for (int j = 0; j < 8; ++j) g_b[j][i] = int8_t((i * 7 + j) % 15 - 7), g_a[j & 1][i] = int8_t(i % 13 - 6);
  const Probe probes[] = {
      {"dp chain", dp_chain},           {"dp x4", dp_x4},
      {"load+dp, one B", load_dp_one_b}, {"load+dp, two B", load_dp_two_b},
      {"load", load_only},              {"lane, one set", lane_one_set},
      {"lane, two sets", lane_two_sets}, {"lane, C over four", lane_four_c},
      {"vstore->load near", vstore_load_near}, {"vstore->load far", vstore_load_far},
      {"tstore->vload near", tstore_vload_near}, {"tstore->vload far", tstore_vload_far},
  };
  printf("ns per iteration, one thread, data in L1; median of %d rounds (min-max), %d iterations\n",
         rounds, n);
  printf("%-22s %20s %20s\n", "sequence", "half (K = 32)", "full (K = 64)");
  for (const Probe& p : probes) {
    std::string cells;
    for (bool half : {true, false}) {
      std::vector<double> t;
      for (int r = 0; r < rounds; ++r) t.push_back(time_ns(p, n, half));
      std::sort(t.begin(), t.end());
      char cell[64];
      snprintf(cell, sizeof cell, "%7.2f (%.2f-%.2f)", t[t.size() / 2], t.front(), t.back());
      cells += std::string(" ") + std::string(20 - std::min<size_t>(20, strlen(cell)), ' ') + cell;
    }
    printf("%-22s%s\n", p.name, cells.c_str());
  }
  return 0;
}
