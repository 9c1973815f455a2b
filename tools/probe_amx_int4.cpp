// Where an int4 AMX pass's time goes (GPU host; tools/probe_amx_int4.sh builds and runs it).
//
// The kernel's int4 pass (ktk_amx.cpp, included whole so its internal helpers are callable here)
// goes in steps of two tile products, each a group of 32 weights by 16 tokens, with four kinds of
// work a step: unpack (nibbles to the int8 B tiles, AVX-512 stores), products (tile loads,
// tdpbssd), C stores (tilestored) and the fold (C times the group scales into fp32 accumulators).
// This times one 16-row block over K at 16 tokens (DeepSeek-V3's gate/up shape by default) with
// each kind switched on or off, so the parts' costs and their overlap show:
//   real        dot_int4 as the kernel calls it (tile configuration included)
//   all         the four parts, in the pass's order (this probe's copy of the pass)
//   late-store  all, with a step's C stored after the next step's products
//   packed-A    all, with the tokens' activations as [K/32][16][32] (a group's A tile one
//               contiguous 512 bytes) instead of 16 rows K bytes apart; packed+late: both
//   -fold, -unpack, -store, -products   the pass without that part (-products: no C stores either)
//   products    tile loads and products alone (B from a block unpacked once)
//   unpack, fold                        that part alone
//   int8        dot_int8 over the same K at 16 tokens (one tile product a 64-wide K step)
// Each row: ns per step (two groups of 32 by 16 tokens), with the block in cache (one block
// reused) and streamed (blocks walked through a buffer past the L3), one thread, then the streamed
// figure with every thread running its own copy at once; the variants take turns, round by round.
//   usage: probe_amx_int4 [K (7168)] [threads (15)] [rounds (3)]
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../expert_service/kernels/ktk_amx.cpp"

extern "C" const ktk_ops* ktk_ops_avx2(void) { return nullptr; }
extern "C" const ktk_ops* ktk_ops_avx512(void) { return nullptr; }

namespace probe {

using Clock = std::chrono::steady_clock;
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: AMX's state

bool amx_permitted() { return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; }

#define PROBE_PRODUCTS(CA, CB)                  \
  _tile_zero(CA);                               \
  _tile_zero(CB);                               \
  _tile_loadd(4, b, 64);                        \
  _tile_loadd(6, x + g * a_step, a_stride);     \
  _tile_dpbssd(CA, 6, 4);                       \
  _tile_loadd(5, b + 512, 64);                  \
  _tile_loadd(7, x + (g + 1) * a_step, a_stride); \
  _tile_dpbssd(CB, 7, 5);

// The pass of ktk_amx.cpp at 16 tokens (NC == 1), each part switched by a flag; B tiles from
// `fixed` where UNPACK is off.
// PACKED: x as [K/32][16 tokens][32] (a group's A tile 512 contiguous bytes) instead of rows of K
template <bool UNPACK, bool PRODUCTS, bool STORE, bool FOLD, bool LATE = false, bool PACKED = false>
void pass(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
          const int8_t* fixed, float* out) {
  const long a_step = PACKED ? 512 : 32, a_stride = PACKED ? 32 : ldx;
  alignas(64) int8_t bq[2][1024];
  alignas(64) int32_t c[3][2][256] = {};
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int steps = K / 64;
  for (int s = 0, ring = 0; s < steps + 2; ++s, ring = ring == 2 ? 0 : ring + 1) {
    if (s < steps) {
      const int g = 2 * s;
      int8_t* b = UNPACK ? bq[s & 1] : const_cast<int8_t*>(fixed);
      if (UNPACK) {
        const char* wpf = reinterpret_cast<const char*>(w + g * 256) + kPrefetchBytes;
        for (int i = 0; i < 512; i += 64) _mm_prefetch(wpf + i, _MM_HINT_T0);
        unpack_group16(w + g * 256, b);
        unpack_group16(w + (g + 1) * 256, b + 512);
      }
      __asm__ volatile("" ::"m"(*reinterpret_cast<const int8_t(*)[1024]>(b)));
      __asm__ volatile("" : "+m"(c[ring][0]), "+m"(c[ring][1]));
      if (PRODUCTS) {
        if (s & 1) {
          PROBE_PRODUCTS(2, 3)
          if (STORE && !LATE) {
            _tile_stored(2, c[ring][0], 64);
            _tile_stored(3, c[ring][1], 64);
          }
        } else {
          PROBE_PRODUCTS(0, 1)
          if (STORE && !LATE) {
            _tile_stored(0, c[ring][0], 64);
            _tile_stored(1, c[ring][1], 64);
          }
        }
      }
      __asm__ volatile("" : "+m"(*reinterpret_cast<int8_t(*)[1024]>(b)));
    }
    if (LATE && STORE && s >= 1 && s <= steps) {  // step s - 1's C, behind step s's products
      const int prev = ring == 0 ? 2 : ring - 1;
      __asm__ volatile("" : "+m"(c[prev][0]), "+m"(c[prev][1]));
      if ((s - 1) & 1) {
        _tile_stored(2, c[prev][0], 64);
        _tile_stored(3, c[prev][1], 64);
      } else {
        _tile_stored(0, c[prev][0], 64);
        _tile_stored(1, c[prev][1], 64);
      }
    }
    if (FOLD && s >= 2) {
      const int back = ring >= 2 ? ring - 2 : ring + 1;
      int4_step_flush<1>(gs, (s - 2) * 2, c[back], acc);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * 16, acc[i]);
}
#undef PROBE_PRODUCTS

struct Data {
  int K;
  size_t blocks;
  std::vector<uint8_t> w4;     // [blocks][K/32][256]
  std::vector<uint16_t> gs;    // [blocks][K/32][16]
  std::vector<int8_t> w8;      // [blocks][K/4][64] (the int8 row: one block per 16 rows)
  std::vector<float> ws;       // [16]
  std::vector<int32_t> wsum;   // [16]
  std::vector<int8_t> x;       // [32][K] (16 rows past the tokens: the tile-load padding)
  std::vector<int8_t> xp;      // x's 16 tokens as [K/32][16][32]
  std::vector<float> xs;       // [32]
  std::vector<int32_t> xg;     // [32][K/32]
  std::vector<int8_t> fixed;   // one step's B tiles
  mutable std::vector<float> out;  // [32][16]: every call's scratch output
  Data(int k, size_t nblocks, uint64_t seed) : K(k), blocks(nblocks) {
    w4.resize(blocks * (K / 32) * 256);
    fill(w4.data(), w4.size(), seed);
    gs.assign(blocks * (K / 32) * 16, 0x3f80);  // bf16 1.0 scales: the values do not matter
    w8.resize(blocks * size_t(K) * 16);
    fill(w8.data(), w8.size(), seed + 1);
    ws.assign(16, 1.0f);
    wsum.assign(16, 0);
    x.resize(32 * size_t(K));
    fill(x.data(), x.size(), seed + 2);
    xp.resize(16 * size_t(K));
    for (int g = 0; g < K / 32; ++g)
      for (int t = 0; t < 16; ++t)
        std::memcpy(&xp[(size_t(g) * 16 + t) * 32], &x[size_t(t) * K + g * 32], 32);
    xs.assign(32, 1.0f);
    xg.assign(32 * size_t(K / 32), 0);
    fixed.resize(1024);
    fill(fixed.data(), fixed.size(), seed + 3);
    out.assign(32 * 16, 0.0f);
  }
  static void fill(void* p, size_t bytes, uint64_t seed) {  // xorshift64*, 8 bytes at a time
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + 1;
    auto* b = static_cast<uint8_t*>(p);
    for (size_t i = 0; i < bytes; i += 8) {
      z ^= z >> 12, z ^= z << 25, z ^= z >> 27;
      const uint64_t v = z * 0x2545f4914f6cdd1dull;
      std::memcpy(b + i, &v, std::min<size_t>(8, bytes - i));
    }
  }
  const uint8_t* w4_block(size_t j) const { return w4.data() + j * (K / 32) * 256; }
  const uint16_t* gs_block(size_t j) const { return gs.data() + j * (K / 32) * 16; }
  const int8_t* w8_block(size_t j) const { return w8.data() + j * size_t(K) * 16; }
};

enum Variant { kReal, kAll, kLate, kPacked, kPackedLate, kNoFold, kNoUnpack, kNoStore,
               kNoProducts, kProducts, kUnpack, kFold, kInt8, kVariants };
const char* const kNames[kVariants] = {"real", "all", "late-store", "packed-A", "packed+late",
                                       "-fold", "-unpack", "-store", "-products",
                                       "products", "unpack", "fold", "int8"};

void call(Variant v, const Data& d, size_t j, float* out) {
  const uint8_t* w = d.w4_block(j);
  const uint16_t* gs = d.gs_block(j);
  const int8_t* x = d.x.data();
  const int8_t* f = d.fixed.data();
  const int K = d.K;
  switch (v) {
    case kReal:
      return kOps.dot_int4(w, gs, K, x, K, d.xs.data(), d.xg.data(), K / 32, 16, 1, out, 256);
    case kInt8:
      return kOps.dot_int8(d.w8_block(j), d.ws.data(), d.wsum.data(), K, x, K, d.xs.data(), 16,
                           out);
    default:
      break;
  }
  configure(8, 32);
  switch (v) {
    case kAll: pass<true, true, true, true>(w, gs, K, x, K, f, out); break;
    case kLate: pass<true, true, true, true, true>(w, gs, K, x, K, f, out); break;
    case kPacked: pass<true, true, true, true, false, true>(w, gs, K, d.xp.data(), K, f, out);
      break;
    case kPackedLate: pass<true, true, true, true, true, true>(w, gs, K, d.xp.data(), K, f, out);
      break;
    case kNoFold: pass<true, true, true, false>(w, gs, K, x, K, f, out); break;
    case kNoUnpack: pass<false, true, true, true>(w, gs, K, x, K, f, out); break;
    case kNoStore: pass<true, true, false, true>(w, gs, K, x, K, f, out); break;
    case kNoProducts: pass<true, false, false, true>(w, gs, K, x, K, f, out); break;
    case kProducts: pass<false, true, false, false>(w, gs, K, x, K, f, out); break;
    case kUnpack: pass<true, false, false, false>(w, gs, K, x, K, f, out); break;
    case kFold: pass<false, false, false, true>(w, gs, K, x, K, f, out); break;
    default: break;
  }
  _tile_release();
}

// ns per call: the median of `reps` timings of `calls` calls each (after one more as a warm-up),
// on one block (cache) or on the next block each call (stream)
double time_calls(Variant v, const Data& d, bool stream, int calls, int reps) {
  std::vector<double> t;
  size_t j = 0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) {
      call(v, d, stream ? j : 0, d.out.data());
      if (++j == d.blocks) j = 0;
    }
    double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / calls;
    if (r > 0) t.push_back(ns);  // the first: warm-up
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace probe

int main(int argc, char** argv) {
  using namespace probe;
  const int K = argc > 1 ? std::atoi(argv[1]) : 7168;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 15;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 3;
  if (K <= 0 || K % 64 || threads <= 0 || rounds <= 0) {
    std::fprintf(stderr,
                 "usage: probe_amx_int4 [K: a multiple of 64] [threads > 0] [rounds > 0]\n");
    return 2;
  }
  if (!amx_permitted()) {  // for the whole process: the pool's threads too
    std::fprintf(stderr, "AMX not permitted on this machine\n");
    return 1;
  }
  // streamed: enough int4 blocks that one thread's walk passes the 300 MB L3 (int8: twice that)
  const size_t stream_bytes = size_t(512) << 20;
  const size_t blocks = std::max<size_t>(64, stream_bytes / (size_t(K) * 8));
  const int steps = K / 64;
  std::printf("K = %d, 16 tokens, 16-row blocks; %zu blocks streamed (int4 %.0f MB, int8 %.0f MB)"
              "; seeds 1..%d\n",
              K, blocks, blocks * K * 8.0 / 1e6, blocks * K * 16.0 / 1e6, threads + 1);
  std::vector<Data*> per_thread(threads + 1);  // [threads]: the one-thread rows' data
  {
    std::vector<std::thread> init;
    for (int t = 0; t <= threads; ++t)
      init.emplace_back([&, t] { per_thread[t] = new Data(K, blocks, 1 + t); });
    for (auto& th : init) th.join();
  }
  const Data& one = *per_thread[threads];
  // rounds: every variant once a round, in turn, so a machine's drift hits them alike; medians
  struct Cell {
    double cache, stream, all;
  };
  std::vector<std::vector<Cell>> cells(kVariants);
  for (int round = 0; round < rounds; ++round)
    for (int v = 0; v < kVariants; ++v) {
      const Variant var = Variant(v);
      Cell c;
      c.cache = time_calls(var, one, false, 200, 5) / steps;
      c.stream = time_calls(var, one, true, 1000, 3) / steps;
      std::vector<double> each(threads);
      std::atomic<int> ready{0};
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          ready.fetch_add(1);
          while (ready.load() < threads) {
          }
          each[t] = time_calls(var, *per_thread[t], true, 1000, 3);
        });
      for (auto& th : pool) th.join();
      std::sort(each.begin(), each.end());
      c.all = each[threads / 2] / steps;
      cells[v].push_back(c);
    }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%-11s | %13s | %13s | %15s | %15s\n", "variant", "cache ns/step", "stream ns/st",
              "threads ns/step", "threads min-max");
  for (int v = 0; v < kVariants; ++v) {
    std::vector<double> cache, stream, all;
    for (const Cell& c : cells[v]) cache.push_back(c.cache), stream.push_back(c.stream),
        all.push_back(c.all);
    std::printf("%-11s | %13.1f | %13.1f | %15.1f | %7.1f-%-7.1f\n", kNames[v], median(cache),
                median(stream), median(all), *std::min_element(all.begin(), all.end()),
                *std::max_element(all.begin(), all.end()));
  }
  std::printf("ns/step: a call's time over its K/64 steps (two groups of 32 by 16 tokens; int8: "
              "one 64-wide tile product), the median of %d rounds; threads: the median thread's "
              "streamed figure with %d threads at once, and its range over the rounds\n", rounds,
              threads);
  for (auto* d : per_thread) delete d;
  return 0;
}
