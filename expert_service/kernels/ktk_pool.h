/* A persistent thread pool: num_threads counts the calling thread, which runs as worker 0.
 * Workers spin on a generation word for spin_us after each job (or wake-up), then sleep on a
 * wake word (futex) that a job or ktk_pool_wake bumps.
 * Used only by the generic translation units (never by an ISA-specific one). */
#ifndef KTK_POOL_H
#define KTK_POOL_H

typedef void (*ktk_task_fn)(void* ctx, int tid, int num_threads);
typedef struct ktk_pool ktk_pool;

ktk_pool* ktk_pool_create(int num_threads, int pin, int spin_us);
void ktk_pool_destroy(ktk_pool* pool);
/* Runs fn(ctx, tid, n) on every thread (the caller is tid 0) and returns when all are done. */
void ktk_pool_run(ktk_pool* pool, ktk_task_fn fn, void* ctx);
/* A barrier among the threads of the running job; every thread must reach it. */
void ktk_pool_barrier(ktk_pool* pool);
int ktk_pool_size(const ktk_pool* pool);
/* One step of a wait inside a job: pause-spin, then yield once *spins says it has been long. */
void ktk_pool_relax(int* spins);
/* Wakes sleeping workers without a job: they spin for spin_us again (no-op when none sleeps). */
void ktk_pool_wake(ktk_pool* pool);

#endif
