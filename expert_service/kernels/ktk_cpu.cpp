// Runtime ISA detection: CPUID + XCR0 (the OS saves the registers) + AMX tile-data permission.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ktk.h"

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

struct Features {
  bool avx2 = false, avx512 = false, amx = false;
};

Features detect() {
  Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  unsigned long long xcr0 = xgetbv0();
  bool ymm_os = (xcr0 & 0x6) == 0x6, zmm_os = (xcr0 & 0xe6) == 0xe6;
  bool tile_os = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30);
  bool avx512vl = b & (1u << 31), vnni = c & (1u << 11);
  bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  unsigned a1, b1, c1, d1;
  bool avx512bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5));
  f.avx2 = ymm_os && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_os && avx512f && avx512bw && avx512vl && vnni && avx512bf16;
#ifdef KTK_AMX_EMULATE  // tests: ktk_amx.cpp runs on ktk_amx_emu.h's software tiles
  f.amx = f.avx512;
  (void)tile_os, (void)amx_bf16, (void)amx_tile, (void)amx_int8;
#else
  f.amx = f.avx512 && tile_os && amx_bf16 && amx_tile && amx_int8 &&
          syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
  return f;
}

const Features& features() {
  static const Features f = detect();
  return f;
}

}  // namespace

extern "C" int ktk_isa_supported(int isa) {
  const Features& f = features();
  switch (isa) {
    case KTK_ISA_AVX2:
      return f.avx2;
    case KTK_ISA_AVX512:
      return f.avx512;
    case KTK_ISA_AMX:
      return f.amx;
    default:
      return 0;
  }
}
