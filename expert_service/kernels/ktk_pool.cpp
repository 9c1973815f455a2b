// Persistent pool: spin, then futex sleep. See ktk_pool.h.
#include "ktk_pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdlib>

struct alignas(64) ktk_pool {
  int n = 1;
  int spin_us = 200;
  int pin = 0;
  ktk_task_fn fn = nullptr;
  void* ctx = nullptr;
  bool stop = false;
  pthread_t* threads = nullptr;
  alignas(64) std::atomic<uint32_t> gen{0};
  alignas(64) std::atomic<int> sleepers{0};
  alignas(64) std::atomic<uint32_t> wake{0};  // the futex word sleepers wait on
  alignas(64) std::atomic<int> done{0};
  alignas(64) std::atomic<int> bar_count{0};
  alignas(64) std::atomic<uint32_t> bar_gen{0};
};

namespace {

struct WorkerArg {
  ktk_pool* pool;
  int tid;
};

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, nullptr, nullptr, 0);
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void pin_to_nth_cpu(int nth) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  int count = CPU_COUNT(&allowed);
  if (count <= 0) return;
  int want = nth % count;
  for (int c = 0, seen = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &allowed)) continue;
    if (seen++ == want) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(c, &one);
      sched_setaffinity(0, sizeof(one), &one);
      return;
    }
  }
}

void* worker_main(void* raw) {
  WorkerArg arg = *static_cast<WorkerArg*>(raw);
  delete static_cast<WorkerArg*>(raw);
  ktk_pool* p = arg.pool;
  if (p->pin) pin_to_nth_cpu(arg.tid);
  uint32_t seen = 0;
  for (;;) {
    int64_t deadline = now_ns() + int64_t(p->spin_us) * 1000;
    int polls = 0;
    while (p->gen.load(std::memory_order_acquire) == seen) {
      _mm_pause();
      if (++polls < 64) continue;
      polls = 0;
      if (now_ns() < deadline) continue;
      // NOTE: sleepers before the re-check of gen, and the waker's gen before its read of
      // sleepers (all seq_cst): either this sees the job or the waker sees a sleeper to wake.
      p->sleepers.fetch_add(1, std::memory_order_seq_cst);
      uint32_t w = p->wake.load(std::memory_order_seq_cst);
      if (p->gen.load(std::memory_order_seq_cst) == seen) futex(&p->wake, FUTEX_WAIT_PRIVATE, w);
      p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      deadline = now_ns() + int64_t(p->spin_us) * 1000;  // woken (job, wake-up or spurious): spin
    }
    seen = p->gen.load(std::memory_order_acquire);
    if (p->stop) return nullptr;
    p->fn(p->ctx, arg.tid, p->n);
    p->done.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace

ktk_pool* ktk_pool_create(int num_threads, int pin, int spin_us) {
  if (num_threads < 1) num_threads = 1;
  ktk_pool* p = new ktk_pool();
  p->n = num_threads;
  p->pin = pin;
  p->spin_us = spin_us < 0 ? 0 : spin_us;
  p->threads = new pthread_t[num_threads];
  for (int t = 1; t < num_threads; ++t) {
    if (pthread_create(&p->threads[t], nullptr, worker_main, new WorkerArg{p, t}) != 0) {
      p->n = t;  // run with the workers we got
      break;
    }
  }
  return p;
}

void ktk_pool_destroy(ktk_pool* p) {
  if (!p) return;
  p->stop = true;
  p->gen.fetch_add(1, std::memory_order_seq_cst);
  p->wake.fetch_add(1, std::memory_order_seq_cst);
  futex(&p->wake, FUTEX_WAKE_PRIVATE, INT_MAX);
  for (int t = 1; t < p->n; ++t) pthread_join(p->threads[t], nullptr);
  delete[] p->threads;
  delete p;
}

void ktk_pool_run(ktk_pool* p, ktk_task_fn fn, void* ctx) {
  if (p->n == 1) {
    fn(ctx, 0, 1);
    return;
  }
  p->fn = fn;
  p->ctx = ctx;
  p->done.store(0, std::memory_order_relaxed);
  p->gen.fetch_add(1, std::memory_order_seq_cst);
  ktk_pool_wake(p);
  fn(ctx, 0, p->n);
  int spins = 0;
  while (p->done.load(std::memory_order_acquire) != p->n - 1) ktk_pool_relax(&spins);
}

void ktk_pool_barrier(ktk_pool* p) {
  if (p->n == 1) return;
  uint32_t g = p->bar_gen.load(std::memory_order_acquire);
  if (p->bar_count.fetch_add(1, std::memory_order_acq_rel) == p->n - 1) {
    p->bar_count.store(0, std::memory_order_relaxed);
    p->bar_gen.fetch_add(1, std::memory_order_release);
  } else {
    int spins = 0;
    while (p->bar_gen.load(std::memory_order_acquire) == g) ktk_pool_relax(&spins);
  }
}

int ktk_pool_size(const ktk_pool* p) { return p->n; }

// NOTE: waits inside a job pause-spin briefly, then yield: when the machine is oversubscribed, a
// descheduled peer gets the core back instead of every waiter burning its time slice.
void ktk_pool_relax(int* spins) {
  if (++*spins < 2048)
    _mm_pause();
  else
    sched_yield();
}

void ktk_pool_wake(ktk_pool* p) {
  if (p->n == 1 || p->sleepers.load(std::memory_order_seq_cst) == 0) return;
  p->wake.fetch_add(1, std::memory_order_seq_cst);
  futex(&p->wake, FUTEX_WAKE_PRIVATE, INT_MAX);
}
