// The forward call: routing, activation preparation, and the three parallel phases
// (gate/up + SiLU*up, intermediate preparation, down + weighted sum) around the ISA micro kernels.
//
// Activation precision (x and the intermediate h), chosen once per call:
//   int8/int4 weights: int8 per token (symmetric), whatever x's dtype;
//   bf16 weights, bf16 x: bf16 (dot_bf16: vdpbf16ps / AMX-BF16);
//   bf16 weights, fp32 x: fp32, the exact mode (dot_bf16_f32: weights widened, fp32 FMA).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "ktk.h"
#include "ktk_common.h"
#include "ktk_pool.h"

namespace {

struct Buffer {
  void* ptr = nullptr;
  size_t size = 0;
  bool reserve(size_t bytes) {
    if (bytes <= size) return true;
    free(ptr);
    size = (bytes + 4095) / 4096 * 4096;
    ptr = aligned_alloc(64, size);
    if (!ptr) size = 0;
    return ptr != nullptr;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  ~Buffer() { free(ptr); }
};

// Atomic counters, zeroed for each call.
struct Counters {
  std::unique_ptr<std::atomic<int>[]> at;
  size_t size = 0;
  std::atomic<int>* zeroed(size_t n) {
    if (n > size) {
      at.reset(new std::atomic<int>[n]);
      size = n;
    }
    for (size_t i = 0; i < n; ++i) at[i].store(0, std::memory_order_relaxed);
    return at.get();
  }
};

}  // namespace

struct ktk_kernel {
  ktk_pool* pool = nullptr;
  const ktk_ops* ops = nullptr;
  int num_threads = 1;
  int64_t last_start_ns = 0, last_end_ns = 0;  // of the last forward call (ktk_last_forward)
  int last_experts = 0;
  Buffer counts, group_expert, group_off, slot_token, slot_weight, token_slot;
  Buffer xt, xa, xs, xg, h, ha, hs, hg, thread_tmp, slot_out;
  Counters group_counters;
  Buffer marks;  // int64_t [num_threads][kMarkStride] of the last forward call
};

namespace {

enum Act { kActInt8 = 0, kActBf16 = 1, kActF32 = 2 };

struct Call {
  const ktk_forward_args* a;
  const ktk_ops* ops;
  ktk_pool* pool;
  int Hp, Ip, P, G;
  int gate_blocks, out_blocks;  // blocks of 16 rows that hold real rows: ceil(I/16), ceil(H/16)
  int act;                      // Act: how x and h are prepared
  size_t act_bytes;             // bytes per activation element: 4 (f32), 2 (bf16) or 1 (int8)
  const int32_t *group_expert, *group_off, *slot_token;
  const int32_t* token_slot;  // [T][k]: the slot of (token, j), -1 where the id was -1
  const float* slot_weight;
  uint8_t* xt;  // [T][Hp] per-token prepared activations
  uint8_t* xa;  // [P][Hp] gathered by slot
  float* xs;    // [T] then [P] scales: xs[T + s]
  int32_t* xg;  // [T][Hp/32] then [P][Hp/32]
  float* h;     // [P][Ip] fp32
  uint8_t* ha;  // [P][Ip] prepared intermediate
  float* hs;    // [P]
  int32_t* hg;  // [P][Ip/32]
  float* thread_tmp;
  size_t thread_tmp_floats;
  size_t thread_tmp_split;  // where a thread's second scratch part (up results / acc) starts
  float* slot_out;  // few tokens: [P][out_blocks * 16] weighted down output per slot; else null
  // Few tokens, per group: its gate/up items done, plus 1 once its h is prepared for the down items.
  std::atomic<int>* group_progress = nullptr;
  // The next gate/up item and the next down item (few tokens) / output block nobody has taken.
  std::atomic<int> gateup_cursor{0}, down_cursor{0};
  int64_t* marks;  // [threads][kMarkStride]
  bool direct;     // one token whose experts are distinct: its prepared row serves every slot
};

// A thread's marks fill one cache line of their own (KTK_MARKS of its 8 slots), so that no two
// threads write the same line.
constexpr int kMarkStride = 8;
static_assert(KTK_MARKS <= kMarkStride, "a thread's marks fit its line");

enum Mark { kMarkStart, kMarkPrepared, kMarkGathered, kMarkGateUp, kMarkDownStart, kMarkDown, kMarkEnd };
static_assert(kMarkEnd + 1 == KTK_MARKS, "ktk.h lists every mark");

// Items [0, total) from a shared cursor of tickets: runs of `run` items until about one run per
// thread is left, then runs of a quarter of that, so that the threads finish close together.
template <typename F>
void take_tapered(std::atomic<int>& tickets, int total, int run, int n, F body) {
  const int tail_run = std::max(1, run / 4);
  const int big = std::max(0, total - n * run) / run;
  for (int k; (k = tickets.fetch_add(1, std::memory_order_relaxed)) < total;) {
    int i0 = k < big ? k * run : big * run + (k - big) * tail_run;
    if (i0 >= total) return;
    body(i0, std::min(total, i0 + (k < big ? run : tail_run)));
  }
}

// Prepares one activation row: n_real values of src (f32 or bf16) into dst (padded to n_pad with
// zeros) as act: f32 (src is f32 then), bf16, or int8 with a scale and group sums (by the ISA's
// quantize_int8 where ops is given; this scalar code is what it must equal byte for byte).
void prep_row(const ktk_ops* ops, int act, const void* src, int src_dtype, int n_real, int n_pad,
              uint8_t* dst, float* scale, int32_t* gsum) {
  const float* sf = static_cast<const float*>(src);
  const uint16_t* sb = static_cast<const uint16_t*>(src);
  if (act == kActF32) {
    float* d = reinterpret_cast<float*>(dst);
    memcpy(d, sf, size_t(n_real) * 4);
    for (int i = n_real; i < n_pad; ++i) d[i] = 0.0f;
    return;
  }
  if (act == kActBf16) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    if (src_dtype == KTK_DT_BF16)
      memcpy(d, sb, size_t(n_real) * 2);
    else
      for (int i = 0; i < n_real; ++i) d[i] = ktk_f32_to_bf16(sf[i]);
    for (int i = n_real; i < n_pad; ++i) d[i] = 0;
    return;
  }
  if (ops)
    return ops->quantize_int8(src, src_dtype, n_real, n_pad, reinterpret_cast<int8_t*>(dst), scale,
                              gsum);
  float amax = 0.0f;
  if (src_dtype == KTK_DT_BF16)
    for (int i = 0; i < n_real; ++i) amax = ktk_max_or(fabsf(ktk_bf16_to_f32(sb[i])), amax);
  else
    for (int i = 0; i < n_real; ++i) amax = ktk_max_or(fabsf(sf[i]), amax);
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *scale = amax / 127.0f;
  int8_t* d = reinterpret_cast<int8_t*>(dst);
  if (src_dtype == KTK_DT_BF16)
    for (int i = 0; i < n_real; ++i) d[i] = int8_t(ktk_round_even(ktk_bf16_to_f32(sb[i]) * inv));
  else
    for (int i = 0; i < n_real; ++i) d[i] = int8_t(ktk_round_even(sf[i] * inv));
  for (int i = n_real; i < n_pad; ++i) d[i] = 0;
  for (int g = 0; g < n_pad / 32; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += d[g * 32 + i];
    gsum[g] = s;
  }
}

inline void split(int total, int tid, int n, int* begin, int* end) {
  *begin = int(int64_t(total) * tid / n);
  *end = int(int64_t(total) * (tid + 1) / n);
}

// The prepared activations of the slots from off on (their rows Hp elements apart): the rows
// gathered by slot, or token 0's own where the call is direct (one token, its experts distinct:
// every group one slot, so no gather; xt keeps 16 rows readable past it, as xa does).
inline const uint8_t* slot_x(const Call& c, int off) {
  return c.direct ? c.xt : c.xa + size_t(off) * c.Hp * c.act_bytes;
}
inline const float* slot_xs(const Call& c, int off) { return c.direct ? c.xs : c.xs + c.a->T + off; }
inline const int32_t* slot_xg(const Call& c, int off) {
  return c.direct ? c.xg : c.xg + size_t(c.a->T + off) * (c.Hp / 32);
}

void gateup_item(Call& c, int item, float* tg, float* tu) {
  const ktk_forward_args* a = c.a;
  int g = item / c.gate_blocks, b = item % c.gate_blocks;
  int e = c.group_expert[g], off = c.group_off[g], M = c.group_off[g + 1] - off;
  size_t block_elems = size_t(16) * c.Hp;
  size_t expert_blocks = size_t(2) * c.Ip / 16;
  size_t jg = size_t(e) * expert_blocks + 2 * b;  // global block index of the gate block
  if (c.act == kActF32) {
    const uint16_t* w = static_cast<const uint16_t*>(a->w13) + jg * block_elems;
    const float* x = reinterpret_cast<const float*>(slot_x(c, off));
    c.ops->dot_bf16_f32(w, c.Hp, x, c.Hp, M, tg);
    c.ops->dot_bf16_f32(w + block_elems, c.Hp, x, c.Hp, M, tu);
  } else if (a->fmt == KTK_FMT_BF16) {
    const uint16_t* w = static_cast<const uint16_t*>(a->w13) + jg * block_elems;
    const uint16_t* x = reinterpret_cast<const uint16_t*>(slot_x(c, off));
    c.ops->dot_bf16(w, c.Hp, x, c.Hp, M, tg);
    c.ops->dot_bf16(w + block_elems, c.Hp, x, c.Hp, M, tu);
  } else if (a->fmt == KTK_FMT_INT8) {
    const int8_t* w = static_cast<const int8_t*>(a->w13) + jg * block_elems;
    const float* ws = static_cast<const float*>(a->s13) + jg * 16;
    const int32_t* wsum = a->r13 + jg * 16;
    const int8_t* x = reinterpret_cast<const int8_t*>(slot_x(c, off));
    const float* xs = slot_xs(c, off);
    c.ops->dot_int8(w, ws, wsum, c.Hp, x, c.Hp, xs, M, tg);
    c.ops->dot_int8(w + block_elems, ws + 16, wsum + 16, c.Hp, x, c.Hp, xs, M, tu);
  } else {
    const uint8_t* w = static_cast<const uint8_t*>(a->w13) + jg * ktk_int4_block_bytes(c.Hp);
    const uint16_t* gs = static_cast<const uint16_t*>(a->s13) + jg * ktk_int4_block_scales(c.Hp);
    const int8_t* x = reinterpret_cast<const int8_t*>(slot_x(c, off));
    const float* xs = slot_xs(c, off);
    int ldg = c.Hp / 32;
    const int32_t* xg = slot_xg(c, off);
    // The gate block and the up block after it in one call.
    c.ops->dot_int4(w, gs, c.Hp, x, c.Hp, xs, xg, ldg, M, 2, tg, size_t(tu - tg));
  }
  c.ops->silu_mul16(tg, tu, M, c.h + size_t(off) * c.Ip + 16 * b, c.Ip);
}

// Slot s's intermediate h (fp32) prepared for the down projection, as the activations were.
void prep_h_row(const Call& c, int s) {
  prep_row(c.ops, c.act, c.h + size_t(s) * c.Ip, KTK_DT_F32, c.a->I, c.Ip,
           c.ha + size_t(s) * c.Ip * c.act_bytes, c.hs + s, c.hg + size_t(s) * (c.Ip / 32));
}

// tmp[i][m][r] = (down block b + i of group g's expert) . h of the group's m-th token, i < nb.
void down_dot(const Call& c, int g, int b, int nb, float* tmp) {
  const ktk_forward_args* a = c.a;
  const int Ip = c.Ip;
  int e = c.group_expert[g], off = c.group_off[g], M = c.group_off[g + 1] - off;
  size_t block_elems = size_t(16) * Ip;
  size_t j = size_t(e) * (size_t(c.Hp) / 16) + b;
  if (a->fmt == KTK_FMT_INT4) {  // one call: the AMX pass runs the blocks as one pipeline
    const uint8_t* w = static_cast<const uint8_t*>(a->w2) + j * ktk_int4_block_bytes(Ip);
    const uint16_t* gs = static_cast<const uint16_t*>(a->s2) + j * ktk_int4_block_scales(Ip);
    const int8_t* x = reinterpret_cast<const int8_t*>(c.ha) + size_t(off) * Ip;
    int ldg = Ip / 32;
    c.ops->dot_int4(w, gs, Ip, x, Ip, c.hs + off, c.hg + size_t(off) * ldg, ldg, M, nb, tmp,
                    size_t(M) * 16);
    return;
  }
  for (int i = 0; i < nb; ++i, ++j) {
    float* out = tmp + size_t(i) * M * 16;
    if (c.act == kActF32) {
      const uint16_t* w = static_cast<const uint16_t*>(a->w2) + j * block_elems;
      const float* x = reinterpret_cast<const float*>(c.ha) + size_t(off) * Ip;
      c.ops->dot_bf16_f32(w, Ip, x, Ip, M, out);
    } else if (a->fmt == KTK_FMT_BF16) {
      const uint16_t* w = static_cast<const uint16_t*>(a->w2) + j * block_elems;
      const uint16_t* x = reinterpret_cast<const uint16_t*>(c.ha) + size_t(off) * Ip;
      c.ops->dot_bf16(w, Ip, x, Ip, M, out);
    } else {
      const int8_t* w = static_cast<const int8_t*>(a->w2) + j * block_elems;
      const float* ws = static_cast<const float*>(a->s2) + j * 16;
      const int8_t* x = reinterpret_cast<const int8_t*>(c.ha) + size_t(off) * Ip;
      c.ops->dot_int8(w, ws, a->r2 + j * 16, Ip, x, Ip, c.hs + off, M, out);
    }
  }
}

constexpr int kFewTokens = 16;  // up to here, the down projection goes by slot (see forward_task)
constexpr int kDownChunk = 64;  // output blocks per accumulation chunk (1024 rows)
// Threads take their work from shared cursors, in runs long enough to stream weights: the cores of
// one machine run at different speeds (GPU host: with fixed shares, the slowest thread took 139 ms
// of a phase whose mean was 100), and an expert's cost is not linear in its tokens. The last ~one
// run per thread of each phase goes in quarter runs (take_tapered), so the threads finish together.
constexpr int kRunsPerThread = 16;       // many tokens: gate/up items in ~16 runs per thread
constexpr int kDownRangesPerThread = 6;  // many tokens: output blocks in ~6 ranges per thread
constexpr int kFewRunsPerThread = 8;     // few tokens: gate/up and down items in ~8 runs per thread

// Output blocks [b0, b1) (b1 - b0 <= kDownChunk): expert by expert, so that each expert's rows of
// the range stream contiguously; weighted sum in acc [T][(b1 - b0) * 16], then written to out.
void down_range(Call& c, int b0, int b1, float* tmp, float* acc) {
  const ktk_forward_args* a = c.a;
  const int T = a->T, width = (b1 - b0) * 16;
  memset(acc, 0, sizeof(float) * width * T);
  for (int g = 0; g < c.G; ++g) {
    int off = c.group_off[g], M = c.group_off[g + 1] - off;
    const int fit = std::max(1, int(c.thread_tmp_split / (size_t(16) * M)));  // blocks tmp holds
    for (int b = b0; b < b1; b += fit) {
      const int nb = std::min(fit, b1 - b);
      down_dot(c, g, b, nb, tmp);
      for (int i = 0; i < nb; ++i)
        for (int m = 0; m < M; ++m) {
          float wt = c.slot_weight[off + m];
          float* dst = acc + size_t(c.slot_token[off + m]) * width + (b + i - b0) * 16;
          const float* src = tmp + (size_t(i) * M + m) * 16;
          for (int r = 0; r < 16; ++r) dst[r] += wt * src[r];
        }
    }
  }
  int row0 = 16 * b0, rows = a->H - row0 < width ? a->H - row0 : width;
  if (a->out_dtype == KTK_DT_F32) {
    float* out = static_cast<float*>(a->out);
    for (int t = 0; t < T; ++t) memcpy(out + size_t(t) * a->H + row0, acc + size_t(t) * width, rows * 4);
  } else {
    uint16_t* out = static_cast<uint16_t*>(a->out);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r)
        out[size_t(t) * a->H + row0 + r] = ktk_f32_to_bf16(acc[size_t(t) * width + r]);
  }
}

// Few tokens, after the activations: gate/up items, then down items, with no barrier between them:
// the thread that finishes a group's last gate/up item prepares that group's h, and a down item
// waits only for its own group's h. Each slot's weighted output rows go to slot_out; then each
// thread sums its output columns over every token's slots, in slot order j (so the result does
// not depend on which thread did what).
void few_tokens_rest(Call& c, int tid, int n, float* tmp, float* tmp_up, int64_t* marks) {
  const ktk_forward_args* a = c.a;
  const int T = a->T, runs = n * kFewRunsPerThread;
  const int gate_items = c.G * c.gate_blocks, gate_run = std::max(1, gate_items / runs);
  take_tapered(c.gateup_cursor, gate_items, gate_run, n, [&](int i0, int i1) {
    for (int i = i0; i < i1;) {
      const int g = i / c.gate_blocks, end = std::min(i1, (g + 1) * c.gate_blocks), taken = end - i;
      for (; i < end; ++i) gateup_item(c, i, tmp, tmp_up);
      // NOTE: acq_rel, so the finisher sees every other thread's rows of h before preparing them.
      std::atomic<int>& progress = c.group_progress[g];
      if (progress.fetch_add(taken, std::memory_order_acq_rel) + taken != c.gate_blocks) continue;
      for (int s = c.group_off[g]; s < c.group_off[g + 1]; ++s) prep_h_row(c, s);
      progress.fetch_add(1, std::memory_order_release);
    }
  });
  marks[kMarkGateUp] = marks[kMarkDownStart] = ktk_now_ns();
  // Every gate/up item has been taken once a thread gets here, so every group's h gets ready.
  const int width = c.out_blocks * 16;
  const int down_items = c.G * c.out_blocks, down_run = std::max(1, down_items / runs);
  take_tapered(c.down_cursor, down_items, down_run, n, [&](int i0, int i1) {
    for (int i = i0; i < i1; ++i) {
      int g = i / c.out_blocks, b = i % c.out_blocks, off = c.group_off[g];
      for (int spins = 0; c.group_progress[g].load(std::memory_order_acquire) <= c.gate_blocks;)
        ktk_pool_relax(&spins);
      down_dot(c, g, b, 1, tmp);
      for (int m = 0; m < c.group_off[g + 1] - off; ++m) {
        float wt = c.slot_weight[off + m];
        float* dst = c.slot_out + size_t(off + m) * width + b * 16;
        for (int r = 0; r < 16; ++r) dst[r] = wt * tmp[m * 16 + r];
      }
    }
  });
  marks[kMarkDown] = ktk_now_ns();
  ktk_pool_barrier(c.pool);
  int lo, hi;
  split(c.out_blocks, tid, n, &lo, &hi);
  const int w0 = lo * 16, w1 = hi * 16 < a->H ? hi * 16 : a->H;
  float* acc = tmp;  // [w1 - w0]
  for (int t = 0; t < T && w0 < w1; ++t) {
    memset(acc, 0, sizeof(float) * (w1 - w0));
    for (int j = 0; j < a->k; ++j) {
      int s = c.token_slot[t * a->k + j];
      if (s < 0) continue;
      const float* src = c.slot_out + size_t(s) * width + w0;
      for (int i = 0; i < w1 - w0; ++i) acc[i] += src[i];
    }
    if (a->out_dtype == KTK_DT_F32) {
      memcpy(static_cast<float*>(a->out) + size_t(t) * a->H + w0, acc, sizeof(float) * (w1 - w0));
    } else {
      uint16_t* out = static_cast<uint16_t*>(a->out) + size_t(t) * a->H;
      for (int i = 0; i < w1 - w0; ++i) out[w0 + i] = ktk_f32_to_bf16(acc[i]);
    }
  }
}

void forward_task(void* raw, int tid, int n) {
  Call& c = *static_cast<Call*>(raw);
  int64_t* marks = c.marks + size_t(tid) * kMarkStride;
  marks[kMarkStart] = ktk_now_ns();
  const ktk_forward_args* a = c.a;
  const int T = a->T, Hp = c.Hp, fmt = a->fmt, act = c.act;
  const int ldgx = Hp / 32;
  size_t xelem = a->x_dtype == KTK_DT_BF16 ? 2 : 4;
  int lo, hi;
  // Phase 0a: per-token activations.
  split(T, tid, n, &lo, &hi);
  for (int t = lo; t < hi; ++t)
    prep_row(c.ops, act, static_cast<const uint8_t*>(a->x) + size_t(t) * a->H * xelem, a->x_dtype, a->H,
             Hp, c.xt + size_t(t) * Hp * c.act_bytes, c.xs + t, c.xg + size_t(t) * ldgx);
  ktk_pool_barrier(c.pool);
  marks[kMarkPrepared] = ktk_now_ns();
  // Phase 0b: gather them by slot (expert-major), so each expert's tokens are contiguous rows.
  if (!c.direct) {
    split(c.P, tid, n, &lo, &hi);
    for (int s = lo; s < hi; ++s) {
      int t = c.slot_token[s];
      memcpy(c.xa + size_t(s) * Hp * c.act_bytes, c.xt + size_t(t) * Hp * c.act_bytes,
             Hp * c.act_bytes);
      c.xs[T + s] = c.xs[t];
      if (fmt == KTK_FMT_INT4)
        memcpy(c.xg + size_t(T + s) * ldgx, c.xg + size_t(t) * ldgx, sizeof(int32_t) * ldgx);
    }
    ktk_pool_barrier(c.pool);
  }
  marks[kMarkGathered] = ktk_now_ns();
  // Phase 1: gate/up, SiLU * up -> h, by runs of (expert, 16-row block) items.
  float* tmp = c.thread_tmp + c.thread_tmp_floats * tid;
  float* tmp_up = tmp + c.thread_tmp_split;
  if (c.slot_out) {
    few_tokens_rest(c, tid, n, tmp, tmp_up, marks);
    marks[kMarkEnd] = ktk_now_ns();
    return;
  }
  const int gate_items = c.G * c.gate_blocks;
  const int runs = n * kRunsPerThread;
  const int gate_run = std::max(1, gate_items / runs);
  take_tapered(c.gateup_cursor, gate_items, gate_run, n, [&](int i0, int i1) {
    for (int i = i0; i < i1; ++i) gateup_item(c, i, tmp, tmp_up);
  });
  marks[kMarkGateUp] = ktk_now_ns();
  ktk_pool_barrier(c.pool);
  // Phase 2: prepare h for the down projection.
  split(c.P, tid, n, &lo, &hi);
  for (int s = lo; s < hi; ++s) prep_h_row(c, s);
  ktk_pool_barrier(c.pool);
  marks[kMarkDownStart] = ktk_now_ns();
  // Phase 3 (many tokens): ranges of output blocks (16 rows each) from a shared cursor; a range's
  // weighted sums go straight into out.
  const int R = std::min(kDownChunk, std::max(2, c.out_blocks / (n * kDownRangesPerThread)));
  take_tapered(c.down_cursor, c.out_blocks, R, n, [&](int b0, int b1) { down_range(c, b0, b1, tmp, tmp_up); });
  marks[kMarkDown] = marks[kMarkEnd] = ktk_now_ns();
}

struct StreamRead {
  const ktk_ops* ops;
  const char* buf;
  size_t bytes;
  uint64_t* xors;  // [threads]
};

void stream_read_task(void* raw, int tid, int n) {
  StreamRead& s = *static_cast<StreamRead*>(raw);
  const size_t steps = s.bytes / KTK_READ_STEP;
  size_t begin = steps * tid / n * KTK_READ_STEP, end = steps * (tid + 1) / n * KTK_READ_STEP;
  s.xors[tid] = s.ops->read_xor(s.buf + begin, end - begin);
}

}  // namespace

extern "C" {

ktk_kernel* ktk_kernel_create(int num_threads, int isa, int pin) {
  if (!ktk_isa_supported(isa)) return nullptr;
  ktk_kernel* k = new ktk_kernel();
  k->ops = isa == KTK_ISA_AMX ? ktk_ops_amx() : isa == KTK_ISA_AVX512 ? ktk_ops_avx512() : ktk_ops_avx2();
  const char* spin = getenv("KTSERVE_KERNEL_SPIN_US");
  k->pool = ktk_pool_create(num_threads, pin, spin ? atoi(spin) : 200);
  k->num_threads = ktk_pool_size(k->pool);
  const size_t mark_bytes = sizeof(int64_t) * kMarkStride * k->num_threads;
  if (!k->marks.reserve(mark_bytes)) {
    ktk_kernel_destroy(k);
    return nullptr;
  }
  memset(k->marks.ptr, 0, mark_bytes);
  return k;
}

void ktk_kernel_destroy(ktk_kernel* k) {
  if (!k) return;
  ktk_pool_destroy(k->pool);
  delete k;
}

int ktk_forward(ktk_kernel* k, const ktk_forward_args* a) {
  k->last_start_ns = ktk_now_ns();
  if (a->fmt < KTK_FMT_BF16 || a->fmt > KTK_FMT_INT4 || a->T < 0 || a->k < 0 || a->E <= 0)
    return KTK_ERR_BAD_ARG;
  if ((a->x_dtype != KTK_DT_F32 && a->x_dtype != KTK_DT_BF16) ||
      (a->out_dtype != KTK_DT_F32 && a->out_dtype != KTK_DT_BF16))
    return KTK_ERR_BAD_ARG;
  const int T = a->T, K = a->k, E = a->E;
  // Routing: count per expert (validating ids before anything is written), then slots.
  if (!k->counts.reserve(sizeof(int32_t) * (E + 1))) return KTK_ERR_NOMEM;
  int32_t* counts = k->counts.as<int32_t>();
  memset(counts, 0, sizeof(int32_t) * (E + 1));
  int P = 0;
  for (int i = 0; i < T * K; ++i) {
    int e = a->ids[i];
    if (e == -1) continue;
    if (e < -1 || e >= E) return KTK_ERR_BAD_ID;
    ++counts[e];
    ++P;
  }
  if (a->expert_counts)
    for (int e = 0; e < E; ++e) a->expert_counts[e] += counts[e];
  Call c;
  c.a = a;
  c.ops = k->ops;
  c.pool = k->pool;
  c.Hp = int(ktk_round_up(a->H, 64));
  c.Ip = int(ktk_round_up(a->I, 64));
  c.P = P;
  c.gate_blocks = (a->I + 15) / 16;
  c.out_blocks = (a->H + 15) / 16;
  c.act = a->fmt != KTK_FMT_BF16 ? kActInt8 : a->x_dtype == KTK_DT_F32 ? kActF32 : kActBf16;
  c.act_bytes = c.act == kActF32 ? 4 : c.act == kActBf16 ? 2 : 1;
  const int n = k->num_threads;
  size_t max_m = size_t(P > T ? P : T);
  // [max_m + 16][16] gate and up results (tmp) + max([max_m + 16][16], [T][kDownChunk * 16]) (acc)
  c.thread_tmp_split = 16 * (max_m + 16);
  c.thread_tmp_floats = c.thread_tmp_split + std::max<size_t>(16 * (max_m + 16), 16 * kDownChunk * T);
  c.thread_tmp_floats = std::max<size_t>(c.thread_tmp_floats, size_t(16) * c.out_blocks);
  bool ok = k->group_expert.reserve(sizeof(int32_t) * E) &&
            k->group_off.reserve(sizeof(int32_t) * (E + 1)) &&
            k->slot_token.reserve(sizeof(int32_t) * (P + 1)) &&
            k->slot_weight.reserve(sizeof(float) * (P + 1)) &&
            k->token_slot.reserve(sizeof(int32_t) * (T * K + 1)) &&
            k->xt.reserve(size_t(T + 16) * c.Hp * c.act_bytes) &&
            k->xa.reserve(size_t(P + 16) * c.Hp * c.act_bytes) &&
            k->xs.reserve(sizeof(float) * (T + P + 1)) &&
            k->xg.reserve(sizeof(int32_t) * (T + P + 1) * (c.Hp / 32)) &&
            k->h.reserve(sizeof(float) * (P + 1) * c.Ip) &&
            k->ha.reserve(size_t(P + 16) * c.Ip * c.act_bytes) &&
            k->hs.reserve(sizeof(float) * (P + 1)) &&
            k->hg.reserve(sizeof(int32_t) * (P + 1) * (c.Ip / 32)) &&
            k->thread_tmp.reserve(sizeof(float) * c.thread_tmp_floats * n);
  if (!ok) return KTK_ERR_NOMEM;
  c.slot_out = nullptr;
  if (T <= kFewTokens) {
    if (!k->slot_out.reserve(sizeof(float) * (P + 1) * c.out_blocks * 16)) return KTK_ERR_NOMEM;
    c.slot_out = k->slot_out.as<float>();
  }
  int32_t* gexp = k->group_expert.as<int32_t>();
  int32_t* goff = k->group_off.as<int32_t>();
  int G = 0;
  for (int e = 0, off = 0; e < E; ++e) {
    if (!counts[e]) continue;
    gexp[G] = e;
    goff[G++] = off;
    int cnt = counts[e];
    counts[e] = off;  // becomes the fill cursor
    off += cnt;
  }
  goff[G] = P;
  int32_t* stok = k->slot_token.as<int32_t>();
  float* sw = k->slot_weight.as<float>();
  int32_t* tslot = k->token_slot.as<int32_t>();
  for (int i = 0; i < T * K; ++i) {
    int e = a->ids[i];
    tslot[i] = -1;
    if (e < 0) continue;
    int s = counts[e]++;
    stok[s] = i / K;
    sw[s] = a->weights[i];
    tslot[i] = s;
  }
  c.G = G;
  c.direct = T == 1 && G == P;
  if (c.slot_out) c.group_progress = k->group_counters.zeroed(size_t(G));
  c.group_expert = gexp;
  c.group_off = goff;
  c.slot_token = stok;
  c.slot_weight = sw;
  c.token_slot = tslot;
  c.xt = k->xt.as<uint8_t>();
  c.xa = k->xa.as<uint8_t>();
  c.xs = k->xs.as<float>();
  c.xg = k->xg.as<int32_t>();
  c.h = k->h.as<float>();
  c.ha = k->ha.as<uint8_t>();
  c.hs = k->hs.as<float>();
  c.hg = k->hg.as<int32_t>();
  c.thread_tmp = k->thread_tmp.as<float>();
  c.marks = k->marks.as<int64_t>();
  ktk_pool_run(k->pool, forward_task, &c);
  k->last_end_ns = ktk_now_ns();
  k->last_experts = G;
  return KTK_OK;
}

void ktk_last_forward(const ktk_kernel* k, int64_t* start_ns, int64_t* end_ns, int* experts) {
  *start_ns = k->last_start_ns;
  *end_ns = k->last_end_ns;
  *experts = k->last_experts;
}

int ktk_quantize_int8(int isa, const void* src, int src_dtype, int n_real, int n_pad, int8_t* dst,
                      float* scale, int32_t* gsum) {
  if (n_real < 0 || n_pad < n_real || n_pad % 32 || (src_dtype != KTK_DT_F32 && src_dtype != KTK_DT_BF16))
    return KTK_ERR_BAD_ARG;
  const ktk_ops* ops = nullptr;
  if (isa != -1) {
    if (!ktk_isa_supported(isa)) return KTK_ERR_BAD_ISA;
    ops = isa == KTK_ISA_AMX ? ktk_ops_amx() : isa == KTK_ISA_AVX512 ? ktk_ops_avx512() : ktk_ops_avx2();
  }
  prep_row(ops, kActInt8, src, src_dtype, n_real, n_pad, reinterpret_cast<uint8_t*>(dst), scale, gsum);
  return KTK_OK;
}

int ktk_last_marks(const ktk_kernel* k, int64_t* out, int cap) {
  for (int i = 0; i < k->num_threads * KTK_MARKS && i < cap; ++i)
    out[i] = k->marks.as<int64_t>()[size_t(i / KTK_MARKS) * kMarkStride + i % KTK_MARKS];
  return k->num_threads;
}

void ktk_kernel_wake(ktk_kernel* k) { ktk_pool_wake(k->pool); }

int ktk_stream_read(ktk_kernel* k, const void* buf, size_t bytes, uint64_t* xor_out) {
  if (bytes % 8) return KTK_ERR_BAD_ARG;
  std::vector<uint64_t> xors(k->num_threads);
  StreamRead s = {k->ops, static_cast<const char*>(buf), bytes, xors.data()};
  ktk_pool_run(k->pool, stream_read_task, &s);
  uint64_t r = 0;
  for (uint64_t v : xors) r ^= v;
  for (size_t i = bytes / KTK_READ_STEP * KTK_READ_STEP; i < bytes; i += 8) {  // the short tail
    uint64_t v;
    memcpy(&v, s.buf + i, 8);
    r ^= v;
  }
  *xor_out = r;
  return KTK_OK;
}

}  // extern "C"
