/* ktk: the CPU MoE kernel's C interface (shared by the generic and the per-ISA translation units).
 *
 * Packed weight layout (one per format, read by every ISA). Hp = roundup(H, 64), Ip = roundup(I, 64).
 * Weights come in blocks of 16 output rows; a block holds its rows for the whole (padded) K:
 *   bf16: uint16 [K/2][16][2]   element (k, r) at (k/2)*32 + r*2 + k%2         (AMX-BF16 B-tile order)
 *   int8: int8   [K/4][16][4]   element (k, r) at (k/4)*64 + r*4 + k%4         (AMX-INT8 B-tile order)
 *   int4: uint8  [K/32][4][64]  group g = k/32, quad q = (k%32)/4, byte g*256 + (q%4)*64 + r*4 + k%4
 *         holds quad q in its low nibble (q < 4) or high nibble (q >= 4), stored as value + 8.
 * w13 (per expert): 2*Ip/16 blocks over K = Hp; block 2b = gate rows 16b.., block 2b+1 = up rows 16b..
 * w2  (per expert): Hp/16 blocks over K = Ip; block b = down rows 16b..
 * Scales, indexed by block j and row r: int8: fp32 s[j*16 + r] (symmetric per output row), int32
 * rowsum[j*16 + r] = sum_k q; int4: bf16 s[(j*(K/32) + g)*16 + r] (symmetric per group of 32 along K).
 * Padding rows/columns are zero.
 */
#ifndef KTK_H
#define KTK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: one table, mirrored in _ext.pyx. */
enum {
  KTK_OK = 0,
  KTK_ERR_BAD_ID = 1,   /* an expert id outside [-1, E) */
  KTK_ERR_NOMEM = 2,    /* scratch allocation failed */
  KTK_ERR_BAD_ISA = 3,  /* the ISA is not compiled in or not supported by this CPU */
  KTK_ERR_BAD_ARG = 4,  /* a shape or format the kernel does not know */
};

enum { KTK_FMT_BF16 = 0, KTK_FMT_INT8 = 1, KTK_FMT_INT4 = 2 };

/* int4, one block (16 rows over K): its bytes of nibbles and its bf16 group scales. */
static inline size_t ktk_int4_block_bytes(int K) { return (size_t)K * 8; }
static inline size_t ktk_int4_block_scales(int K) { return (size_t)(K / 32) * 16; }
enum { KTK_ISA_AVX2 = 0, KTK_ISA_AVX512 = 1, KTK_ISA_AMX = 2 };
enum { KTK_DT_F32 = 0, KTK_DT_BF16 = 1, KTK_DT_F16 = 2, KTK_DT_F8E4M3 = 3 /* packing only */ };

/* Per-ISA micro kernels: out[m][r] = sum_k W[r][k] * X[m][k] for the 16 rows r of one block,
 * m < M tokens whose activations are rows of X (stride ldx elements), K a multiple of 64.
 * dot_bf16: bf16 activations (bf16 products, fp32 accumulation).
 * dot_bf16_f32: fp32 activations (the exact mode): each bf16 weight widened to fp32 (exact), fp32
 * FMA, fp32 accumulation. AMX has no fp32 tile product: its table points to the AVX-512 code.
 * int8/int4: X holds int8 activations with per-row scale xs[m]; the result is dequantized.
 * int4: xg[m*ldg + g] = sum of X[m][32g .. 32g+31]; nb consecutive blocks in one call (their
 * nibbles and group scales contiguous, as packed), block b's [M][16] result at out + b * ldo (AMX
 * runs them as one pipelined pass).
 * read_xor: the xor of the 64-bit words of p[0, bytes) (bytes a multiple of KTK_READ_STEP), read
 * with the ISA's widest loads: a plain streaming read, for measuring the read bandwidth the kernel
 * gets.
 * silu_mul16: h[m*ldh + r] = silu(gate[m*16 + r]) * up[m*16 + r] for m < rows, r < 16 (one block's
 * gate and up results), silu(v) = v / (1 + e^-v) with e^x from a polynomial within 2 ulp of expf
 * (the AVX2 code in every table).
 * quantize_int8: one activation row of n_real values (f32, or bf16 for src_dtype KTK_DT_BF16) to
 * int8 with one scale (amax / 127; values rounded half to even, NaN to 0), zeros up to n_pad (a
 * multiple of 32), and the sums of each 32 (gsum[n_pad / 32]); the same bytes as the scalar
 * quantizer in ktk_moe.cpp (the AVX2 code in every table). */
#define KTK_READ_STEP 256
typedef struct {
  void (*dot_bf16)(const uint16_t* w, int K, const uint16_t* x, int ldx, int M, float* out);
  void (*dot_bf16_f32)(const uint16_t* w, int K, const float* x, int ldx, int M, float* out);
  void (*dot_int8)(const int8_t* w, const float* ws, const int32_t* wsum, int K, const int8_t* x,
                   int ldx, const float* xs, int M, float* out);
  void (*dot_int4)(const uint8_t* w, const uint16_t* gs, int K, const int8_t* x, int ldx,
                   const float* xs, const int32_t* xg, int ldg, int M, int nb, float* out,
                   size_t ldo);
  uint64_t (*read_xor)(const void* p, size_t bytes);
  void (*silu_mul16)(const float* gate, const float* up, int rows, float* h, int ldh);
  void (*quantize_int8)(const void* src, int src_dtype, int n_real, int n_pad, int8_t* dst,
                        float* scale, int32_t* gsum);
} ktk_ops;

const ktk_ops* ktk_ops_avx2(void);
const ktk_ops* ktk_ops_avx512(void);
const ktk_ops* ktk_ops_amx(void);

/* CPU features (CPUID + OS state; AMX also asks the kernel for tile-data permission). */
int ktk_isa_supported(int isa);

/* Packing (multithreaded, any source dtype): gate, up [E, I, H]; down [E, H, I], contiguous;
 * or, where gate_e/up_e/down_e are set, one pointer per expert to its own [I, H] / [H, I]
 * (tensors read straight from a memory-mapped checkpoint). KTK_DT_F8E4M3 sources (per expert
 * only) carry fp32 block scales per expert, [ceil(rows / block_rows), ceil(cols / block_cols)]:
 * w[r][c] = fp8(q[r][c]) * scale[r / block_rows][c / block_cols]. */
typedef struct {
  int fmt, E, H, I, src_dtype, num_threads;
  const void *gate, *up, *down;
  const void *const *gate_e, *const *up_e, *const *down_e;
  const float *const *gate_s, *const *up_s, *const *down_s;
  int block_rows, block_cols;
  void *w13, *w2;          /* packed weights */
  void *s13, *s2;          /* scales (int8: fp32 per row, int4: bf16 per group) */
  int32_t *r13, *r2;       /* int8 row sums of q */
} ktk_pack_args;
int ktk_pack(const ktk_pack_args* a);

/* The forward call. */
typedef struct ktk_kernel ktk_kernel;
typedef struct {
  int fmt, E, H, I;
  const void *w13, *w2, *s13, *s2;
  const int32_t *r13, *r2;
  int T, k;
  const void* x;
  int x_dtype; /* KTK_DT_F32 or KTK_DT_BF16; with bf16 weights, F32 selects the exact fp32 mode */
  const int32_t* ids;
  const float* weights;
  void* out;
  int out_dtype;
  int64_t* expert_counts; /* optional [E]: each expert's tokens of the call are added to it */
} ktk_forward_args;

ktk_kernel* ktk_kernel_create(int num_threads, int isa, int pin);
void ktk_kernel_destroy(ktk_kernel* kern);
int ktk_forward(ktk_kernel* kern, const ktk_forward_args* a);
/* The kernel's last forward call: CLOCK_MONOTONIC ns at its start and its end, and how many
 * distinct experts it ran (all 0 before one). */
void ktk_last_forward(const ktk_kernel* kern, int64_t* start_ns, int64_t* end_ns, int* experts);
/* One activation row quantized as a forward call quantizes it (ktk_ops.quantize_int8) on isa, or
 * by the scalar code it must equal where isa is -1: for tests. KTK_ERR_BAD_ISA where isa is not
 * supported, KTK_ERR_BAD_ARG where n_pad is not a multiple of 32 at least n_real. */
int ktk_quantize_int8(int isa, const void* src, int src_dtype, int n_real, int n_pad, int8_t* dst,
                      float* scale, int32_t* gsum);
/* Each pool thread's phase marks in the last forward call (CLOCK_MONOTONIC ns; one clock read
 * each): [thread][KTK_MARKS] into out (cap values at most); returns the thread count. Marks:
 *   0 the thread started its part      1 the activations were prepared (all threads)
 *   2 they were gathered by expert     3 the thread took no more gate/up work
 *   4 it began down work (many tokens: the intermediate prepared by all threads; few: as 3)
 *   5 it took no more down work        6 it ended its part (few tokens: its output columns summed)
 * (all 0 before a call). */
#define KTK_MARKS 7
int ktk_last_marks(const ktk_kernel* kern, int64_t* out, int cap);
/* Wakes pool threads that sleep, so they spin when the next forward call comes: a caller that
 * knows a call is coming (a request arrived) overlaps their wake-up with its own preparation. */
void ktk_kernel_wake(ktk_kernel* kern);
/* Every pool thread reads one contiguous slice of buf[0, bytes) (as a forward call streams its
 * weights); *xor_out = the xor of all 64-bit words. bytes must be a multiple of 8. */
int ktk_stream_read(ktk_kernel* kern, const void* buf, size_t bytes, uint64_t* xor_out);

#ifdef __cplusplus
}
#endif
#endif
