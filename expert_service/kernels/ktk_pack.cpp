// Quantize and pack expert weights into the layout described in ktk.h (generic code, any CPU).
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "ktk.h"
#include "ktk_common.h"

namespace {

struct Matrix {
  const void* src;                // [E, N, K] of src_dtype, or
  const void* const* per_expert;  // E pointers to [N, K] (when set)
  const float* const* scales;     // F8E4M3: E pointers to [ceil(N / br), ceil(K / bc)]
  int N, K;                       // logical
  int Kp;                         // padded K
};

size_t dtype_bytes(int dtype) { return dtype == KTK_DT_F32 ? 4 : dtype == KTK_DT_F8E4M3 ? 1 : 2; }

// float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN) to fp32, exactly: a table of all 256 values.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int v = 0; v < 256; ++v) {
      int exp = (v >> 3) & 15, mant = v & 7;
      float mag = exp == 0 ? std::ldexp(float(mant), -9) : std::ldexp(float(8 + mant), exp - 10);
      if (exp == 15 && mant == 7) mag = NAN;
      value[v] = (v & 128) ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

// Reads 16 rows starting at row0 of expert e into dst[16][Kp] fp32, zero padded.
void load_rows(const Matrix& m, const ktk_pack_args* a, int e, int row0, float* dst) {
  const int dtype = a->src_dtype;
  const char* base = m.per_expert ? static_cast<const char*>(m.per_expert[e])
                                  : static_cast<const char*>(m.src) +
                                        size_t(e) * m.N * m.K * dtype_bytes(dtype);
  for (int r = 0; r < 16; ++r) {
    float* d = dst + size_t(r) * m.Kp;
    int row = row0 + r;
    if (row >= m.N) {
      memset(d, 0, sizeof(float) * m.Kp);
      continue;
    }
    size_t off = size_t(row) * m.K;
    if (dtype == KTK_DT_F32) {
      memcpy(d, reinterpret_cast<const float*>(base) + off, sizeof(float) * m.K);
    } else if (dtype == KTK_DT_BF16) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(base) + off;
      for (int k = 0; k < m.K; ++k) d[k] = ktk_bf16_to_f32(s[k]);
    } else if (dtype == KTK_DT_F16) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(base) + off;
      for (int k = 0; k < m.K; ++k) d[k] = ktk_f16_to_f32(s[k]);
    } else {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(base) + off;
      const int bc = a->block_cols, scale_cols = (m.K + bc - 1) / bc;
      const float* scale = m.scales[e] + size_t(row / a->block_rows) * scale_cols;
      for (int c = 0, k = 0; c < scale_cols; ++c) {
        const float sc = scale[c];
        for (const int end = k + bc < m.K ? k + bc : m.K; k < end; ++k) d[k] = kFp8.value[s[k]] * sc;
      }
    }
    for (int k = m.K; k < m.Kp; ++k) d[k] = 0.0f;
  }
}

void pack_block_bf16(const float* rows, int Kp, uint16_t* out) {
  for (int k = 0; k < Kp; k += 2)
    for (int r = 0; r < 16; ++r) {
      out[(k / 2) * 32 + r * 2] = ktk_f32_to_bf16(rows[size_t(r) * Kp + k]);
      out[(k / 2) * 32 + r * 2 + 1] = ktk_f32_to_bf16(rows[size_t(r) * Kp + k + 1]);
    }
}

void pack_block_int8(const float* rows, int Kp, int8_t* out, float* scale, int32_t* rowsum,
                     int8_t* q /* [16][Kp] scratch */) {
  for (int r = 0; r < 16; ++r) {
    const float* w = rows + size_t(r) * Kp;
    float amax = 0.0f;
    for (int k = 0; k < Kp; ++k) amax = ktk_max_or(fabsf(w[k]), amax);
    float s = amax / 127.0f;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    int8_t* qr = q + size_t(r) * Kp;
    for (int k = 0; k < Kp; ++k) {
      float v = ktk_clamp(ktk_round_even(w[k] * inv), -127.0f, 127.0f);
      qr[k] = int8_t(v);
      sum += qr[k];
    }
    scale[r] = s;
    rowsum[r] = sum;
  }
  for (int k = 0; k < Kp; k += 4)
    for (int r = 0; r < 16; ++r)
      for (int i = 0; i < 4; ++i) out[(k / 4) * 64 + r * 4 + i] = q[size_t(r) * Kp + k + i];
}

uint16_t bf16_round_up(float s) {  // smallest bf16 >= s (s >= 0)
  uint16_t b = ktk_f32_to_bf16(s);
  if (ktk_bf16_to_f32(b) < s) ++b;
  return b;
}

void pack_block_int4(const float* rows, int Kp, uint8_t* out, uint16_t* scale /* [Kp/32][16] */,
                     uint8_t* q /* [16][Kp] scratch, value + 8 */) {
  int groups = Kp / 32;
  for (int r = 0; r < 16; ++r) {
    const float* w = rows + size_t(r) * Kp;
    uint8_t* qr = q + size_t(r) * Kp;
    for (int g = 0; g < groups; ++g) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = ktk_max_or(fabsf(w[g * 32 + i]), amax);
      uint16_t sb = bf16_round_up(amax / 7.0f);
      float s = ktk_bf16_to_f32(sb);
      float inv = s > 0.0f ? 1.0f / s : 0.0f;
      for (int i = 0; i < 32; ++i) {
        float v = ktk_clamp(ktk_round_even(w[g * 32 + i] * inv), -8.0f, 7.0f);
        qr[g * 32 + i] = uint8_t(int(v) + 8);
      }
      scale[g * 16 + r] = sb;
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < 16; ++r)
        for (int i = 0; i < 4; ++i) {
          uint8_t lo = q[size_t(r) * Kp + g * 32 + c * 4 + i];
          uint8_t hi = q[size_t(r) * Kp + g * 32 + (c + 4) * 4 + i];
          out[g * 256 + c * 64 + r * 4 + i] = uint8_t(lo | (hi << 4));
        }
}

struct Job {
  const ktk_pack_args* a;
  Matrix gate, up, down;
  int Hp, Ip;
};

// One unit of work: all blocks of one matrix (0 = gate/up pair, 1 = down) of one expert.
void pack_unit(const Job& job, int e, int which, float* rows, uint8_t* q) {
  const ktk_pack_args* a = job.a;
  const int Hp = job.Hp, Ip = job.Ip;
  int num_blocks = which == 0 ? 2 * Ip / 16 : Hp / 16;
  int Kp = which == 0 ? Hp : Ip;
  size_t block_elems = size_t(16) * Kp;
  size_t expert_elems = size_t(num_blocks) * block_elems;
  size_t expert_rows = size_t(num_blocks) * 16;
  for (int j = 0; j < num_blocks; ++j) {
    const Matrix& m = which == 1 ? job.down : (j % 2 == 0 ? job.gate : job.up);
    int row0 = which == 1 ? j * 16 : (j / 2) * 16;
    load_rows(m, a, e, row0, rows);
    void* wdst = which == 0 ? a->w13 : a->w2;
    void* sdst = which == 0 ? a->s13 : a->s2;
    if (a->fmt == KTK_FMT_BF16) {
      uint16_t* w = static_cast<uint16_t*>(wdst) + e * expert_elems + j * block_elems;
      pack_block_bf16(rows, Kp, w);
    } else if (a->fmt == KTK_FMT_INT8) {
      int8_t* w = static_cast<int8_t*>(wdst) + e * expert_elems + j * block_elems;
      float* s = static_cast<float*>(sdst) + e * expert_rows + j * 16;
      int32_t* rs = (which == 0 ? a->r13 : a->r2) + e * expert_rows + j * 16;
      pack_block_int8(rows, Kp, w, s, rs, reinterpret_cast<int8_t*>(q));
    } else {
      size_t block = size_t(e) * num_blocks + j;
      uint8_t* w = static_cast<uint8_t*>(wdst) + block * ktk_int4_block_bytes(Kp);
      uint16_t* s = static_cast<uint16_t*>(sdst) + block * ktk_int4_block_scales(Kp);
      pack_block_int4(rows, Kp, w, s, q);
    }
  }
}

}  // namespace

extern "C" int ktk_pack(const ktk_pack_args* a) {
  if (a->fmt < KTK_FMT_BF16 || a->fmt > KTK_FMT_INT4 || a->E <= 0 || a->H <= 0 || a->I <= 0)
    return KTK_ERR_BAD_ARG;
  const bool per_expert = a->gate_e && a->up_e && a->down_e;
  if (a->src_dtype < KTK_DT_F32 || a->src_dtype > KTK_DT_F8E4M3 ||
      (!per_expert && (a->gate_e || a->up_e || a->down_e)))
    return KTK_ERR_BAD_ARG;
  if (a->src_dtype == KTK_DT_F8E4M3 &&
      (!per_expert || !a->gate_s || !a->up_s || !a->down_s || a->block_rows <= 0 ||
       a->block_cols <= 0))
    return KTK_ERR_BAD_ARG;
  Job job;
  job.a = a;
  job.Hp = int(ktk_round_up(a->H, 64));
  job.Ip = int(ktk_round_up(a->I, 64));
  job.gate = Matrix{a->gate, a->gate_e, a->gate_s, a->I, a->H, job.Hp};
  job.up = Matrix{a->up, a->up_e, a->up_s, a->I, a->H, job.Hp};
  job.down = Matrix{a->down, a->down_e, a->down_s, a->H, a->I, job.Ip};
  int units = 2 * a->E;
  int nt = a->num_threads > 0 ? a->num_threads : int(std::thread::hardware_concurrency());
  if (nt > units) nt = units;
  if (nt < 1) nt = 1;
  size_t maxK = size_t(job.Hp > job.Ip ? job.Hp : job.Ip);
  std::atomic<int> next{0};
  auto worker = [&]() {
    std::vector<float> rows(16 * maxK);
    std::vector<uint8_t> q(16 * maxK);
    for (int u; (u = next.fetch_add(1)) < units;) pack_unit(job, u / 2, u % 2, rows.data(), q.data());
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < nt; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return KTK_OK;
}
