/* ktshm: the shared-memory layout and its lock-free hot path.
 *
 * Everything here is header-only C11 so that channel.pyx can inline it. The Python-facing
 * docstring in channel.pyx draws the layout and the state machine; this file is the source of
 * truth for offsets and status codes (mirrored by _ktshm.pxd).
 */
#ifndef KTSHM_H
#define KTSHM_H

#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KT_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define KT_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define KT_CPU_RELAX() ((void)0)
#endif

#define KT_MAGIC 0x314d485354534b4bULL /* "KKTSHM1" little-endian, plus '1' */
#define KT_LAYOUT_VERSION 2u
#define KT_HEADER_BYTES 4096u
#define KT_SLOT_HEADER_BYTES 512u
#define KT_REGION_ALIGN 4096u
#define KT_ARRAY_ALIGN 64u
#define KT_MAX_ARRAYS 4u
#define KT_MAX_DIMS 4u
#define KT_FLAG_DEVICE 1u /* header flags: the slots are rung by their bells, not their words */

/* Status codes: one table for C, the .pxd and Python (errors.py maps them to exceptions). */
enum kt_status {
    KT_OK = 0,
    KT_ETIMEOUT = 1,        /* the wait passed its deadline */
    KT_EPEER_DIED = 2,      /* the peer's heartbeat stopped (killed, crashed, detached) */
    KT_EPEER_RESTARTED = 3, /* a new consumer attached: in-flight requests must be resent */
    KT_EBADMSG = 4,         /* metadata of a slot failed validation */
    KT_ETOOLARGE = 5,       /* payload larger than a slot region */
    KT_EREMOTE = 6,         /* the peer answered with an error status */
    KT_ESYS = 7,            /* a system call failed (errno kept by the caller) */
};

/* Slot state word (64 bits): [seq low 32 | epoch 16 | state 16].
 * NOTE: the word is the only field written with atomics; every other slot field is published
 * by a store-release of the word and read after a load-acquire of it. Carrying seq and epoch in
 * the word makes each compare-and-swap ABA-proof against resends and slot reuse. */
enum kt_slot_state {
    KT_SLOT_FREE = 0,
    KT_SLOT_REQUEST = 1, /* producer -> consumer: request region valid */
    KT_SLOT_BUSY = 2,    /* consumer took it */
    KT_SLOT_REPLY = 3,   /* consumer -> producer: reply region valid */
};

/* Device channels (KT_FLAG_DEVICE): a GPU stream, not a CPU thread, produces, and it can only
 * write constants (cuStreamWriteValue32) and wait for them (cuStreamWaitValue32). So each slot
 * has two 32-bit bells instead of a seq/epoch word, and one call per slot is in flight at once:
 *
 *   request_bell  IDLE --device: post--> POSTED --consumer: CAS--> CLAIMED --device--> IDLE
 *   reply_bell    0 --consumer: store-release after the reply--> 1 --device, after reading--> 0
 *
 * The device posts only after it reset both bells, so a consumer never sees a stale reply_bell.
 * The request metadata is written by the host before it launches the device's work. A consumer
 * that dies holding a CLAIMED slot is replaced by re-posting it (the inputs are still there). */
enum kt_bell {
    KT_BELL_IDLE = 0,
    KT_BELL_POSTED = 1,
    KT_BELL_CLAIMED = 2,
};

static inline uint64_t kt_word(uint64_t seq, uint32_t epoch, uint32_t state) {
    return ((seq & 0xffffffffULL) << 32) | ((uint64_t)(epoch & 0xffffu) << 16) | (state & 0xffffu);
}
static inline uint32_t kt_word_state(uint64_t w) { return (uint32_t)(w & 0xffffu); }
static inline uint32_t kt_word_epoch(uint64_t w) { return (uint32_t)((w >> 16) & 0xffffu); }
static inline uint32_t kt_word_seq32(uint64_t w) { return (uint32_t)(w >> 32); }

typedef struct {
    uint8_t dtype; /* channel.pyx DTYPE_CODES */
    uint8_t ndim;
    uint16_t _pad;
    uint32_t shape[KT_MAX_DIMS];
    uint32_t _pad2;
    uint64_t offset; /* from the start of the region, KT_ARRAY_ALIGN-aligned */
    uint64_t nbytes;
} kt_array_meta; /* 40 bytes */

typedef struct {
    uint32_t kind;
    uint32_t layer;
    uint32_t num_tokens;
    int32_t status;      /* KT_OK or an error code; a reply carries the consumer's status */
    uint32_t num_arrays; /* <= KT_MAX_ARRAYS */
    uint32_t message_len; /* error text at region offset 0 when status != KT_OK */
    kt_array_meta arrays[KT_MAX_ARRAYS];
} kt_meta; /* 184 bytes */

typedef struct {
    _Atomic uint64_t word;
    uint8_t _line0[56];
    uint64_t seq;  /* full sequence number (the word holds its low 32 bits) */
    uint32_t epoch; /* epoch the request was stamped with */
    uint32_t _pad;
    kt_meta request;
    kt_meta reply;
    _Atomic uint32_t request_bell; /* device channels only (enum kt_bell) */
    _Atomic uint32_t reply_bell;
    /* CLOCK_MONOTONIC when the producer published the request (0: not stamped, e.g. a device
     * channel); written before the word's store-release, like the metadata. For timing only. */
    uint64_t request_ns;
} kt_slot_header;

typedef struct {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t num_slots;
    uint64_t region_bytes; /* payload bytes of one request or reply region */
    uint64_t slot_stride;
    uint32_t creator_pid;
    uint32_t flags; /* KT_FLAG_* */
    uint64_t created_ns;
    uint8_t _line0[16];
    _Atomic uint64_t producer_heartbeat_ns; /* offset 64 */
    uint8_t _line1[56];
    _Atomic uint64_t consumer_heartbeat_ns; /* offset 128 */
    _Atomic uint32_t consumer_pid;
    _Atomic uint32_t epoch; /* bumped by every consumer attach */
    uint8_t _line2[48];
    _Atomic uint32_t producer_sleeping; /* offset 192 */
    uint8_t _line3[60];
    _Atomic uint32_t consumer_sleeping; /* offset 256 */
    uint8_t _line4[60];
    _Atomic uint32_t device_done; /* offset 320: the device's work of one step has ended */
    uint8_t _line5[60];
} kt_header;

_Static_assert(sizeof(kt_slot_header) <= KT_SLOT_HEADER_BYTES, "slot header too large");
_Static_assert(sizeof(kt_header) <= KT_HEADER_BYTES, "header too large");
_Static_assert(offsetof(kt_slot_header, request_bell) == 448, "bells moved");
_Static_assert(offsetof(kt_slot_header, request_ns) == 456, "request_ns moved");
_Static_assert(offsetof(kt_header, device_done) == 320, "device_done moved");

static inline uint64_t kt_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A mapping and its geometry, validated once and kept in private memory.
 * NOTE: the segment is the peer's input: its header's num_slots, slot_stride and region_bytes
 * are read once, at create or attach; every address is computed from this copy, so a peer that
 * rewrites the header afterwards cannot move an access outside the mapping. */
typedef struct {
    void *base;
    uint32_t num_slots;
    uint64_t stride;
    uint64_t region;
} kt_map;

static inline kt_slot_header *kt_slot(const kt_map *m, uint32_t index) {
    return (kt_slot_header *)((char *)m->base + KT_HEADER_BYTES + (uint64_t)index * m->stride);
}

static inline uint64_t kt_load_acquire(_Atomic uint64_t *p) {
    return atomic_load_explicit(p, memory_order_acquire);
}
static inline void kt_store_release(_Atomic uint64_t *p, uint64_t v) {
    atomic_store_explicit(p, v, memory_order_release);
}
static inline int kt_cas(_Atomic uint64_t *p, uint64_t expected, uint64_t desired) {
    return atomic_compare_exchange_strong_explicit(p, &expected, desired, memory_order_acq_rel,
                                                   memory_order_acquire);
}

static inline uint32_t kt_bell_load(_Atomic uint32_t *p) {
    return atomic_load_explicit(p, memory_order_acquire);
}
static inline void kt_bell_store(_Atomic uint32_t *p, uint32_t v) {
    atomic_store_explicit(p, v, memory_order_release);
}
static inline int kt_bell_cas(_Atomic uint32_t *p, uint32_t expected, uint32_t desired) {
    return atomic_compare_exchange_strong_explicit(p, &expected, desired, memory_order_acq_rel,
                                                   memory_order_acquire);
}

/* Wake-up without lost wake-ups (Dekker-style, both sides seq_cst):
 *   waiter: sleeping = 1; fence; re-check condition; sem_timedwait; sleeping = 0
 *   poster: publish (release); fence; if (sleeping) sem_post
 * Either the waiter's re-check sees the publication, or the poster sees sleeping == 1. A post
 * that finds no sleeper is skipped, so the semaphore's count stays near zero. */
static inline void kt_notify(_Atomic uint32_t *sleeping, sem_t *sem) {
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(sleeping, memory_order_relaxed)) sem_post(sem);
}

/* What a waiter is waiting for, and the peer it depends on. */
typedef struct {
    const kt_map *map;
    int is_producer;
    int device; /* consumer of a device channel: claim POSTED bells */
    _Atomic uint32_t *bell; /* producer: wait for *bell == bell_value instead of a word */
    uint32_t bell_value;
    /* producer: the slot and word it expects; consumer: scans all slots for its epoch */
    uint32_t slot_index;
    uint64_t expect_word;
    uint32_t known_epoch; /* producer: its requests' stamp; consumer: the epoch it attached as */
    uint64_t spin_ns;
    uint64_t deadline_ns; /* absolute CLOCK_MONOTONIC */
    uint64_t peer_timeout_ns;
    sem_t *sem;
    /* out */
    uint32_t found_index; /* consumer: slot holding the oldest request */
    uint64_t found_word;
} kt_wait_args;

/* Returns 1 when the condition holds (out fields set), 0 otherwise. */
static inline int kt_check(kt_wait_args *a) {
    if (a->is_producer && a->bell) {
        return atomic_load_explicit(a->bell, memory_order_acquire) == a->bell_value;
    }
    if (a->is_producer) {
        uint64_t w = kt_load_acquire(&kt_slot(a->map, a->slot_index)->word);
        if (w == a->expect_word) {
            a->found_word = w;
            return 1;
        }
        return 0;
    }
    if (a->device) {
        for (uint32_t i = 0; i < a->map->num_slots; i++) {
            if (atomic_load_explicit(&kt_slot(a->map, i)->request_bell, memory_order_acquire) ==
                KT_BELL_POSTED) {
                a->found_index = i;
                return 1;
            }
        }
        return 0;
    }
    uint32_t epoch = a->known_epoch & 0xffffu;
    int found = 0;
    uint32_t best_seq = 0;
    for (uint32_t i = 0; i < a->map->num_slots; i++) {
        uint64_t w = kt_load_acquire(&kt_slot(a->map, i)->word);
        if (kt_word_state(w) != KT_SLOT_REQUEST || kt_word_epoch(w) != epoch) continue;
        uint32_t s = kt_word_seq32(w);
        /* oldest first; sequence numbers compared with wrap-around */
        if (!found || (int32_t)(s - best_seq) < 0) {
            best_seq = s;
            a->found_index = i;
            a->found_word = w;
            found = 1;
        }
    }
    return found;
}

/* Peer liveness, checked every so often while waiting. Returns KT_OK or an error. */
static inline int kt_check_peer(kt_wait_args *a, uint64_t now) {
    kt_header *h = (kt_header *)a->map->base;
    if (a->is_producer) {
        uint32_t epoch = atomic_load_explicit(&h->epoch, memory_order_acquire) & 0xffffu;
        if (epoch != (a->known_epoch & 0xffffu)) {
            uint64_t hb = atomic_load_explicit(&h->consumer_heartbeat_ns, memory_order_acquire);
            if (hb != 0 && now - hb <= a->peer_timeout_ns) return KT_EPEER_RESTARTED;
            return KT_EPEER_DIED;
        }
        uint64_t hb = atomic_load_explicit(&h->consumer_heartbeat_ns, memory_order_acquire);
        if (hb == 0 || (now > hb && now - hb > a->peer_timeout_ns)) return KT_EPEER_DIED;
        return KT_OK;
    }
    if ((atomic_load_explicit(&h->epoch, memory_order_acquire) & 0xffffu) !=
        (a->known_epoch & 0xffffu))
        return KT_EPEER_RESTARTED; /* another consumer attached: this one is superseded */
    uint64_t hb = atomic_load_explicit(&h->producer_heartbeat_ns, memory_order_acquire);
    if (hb == 0 || (now > hb && now - hb > a->peer_timeout_ns)) return KT_EPEER_DIED;
    return KT_OK;
}

#define KT_BLOCK_SLICE_NS 20000000ULL /* 20 ms: peer liveness is re-checked at least this often */
#define KT_SPIN_CLOCK_EVERY 64u

/* Spin for spin_ns, then block on the semaphore in slices; never past deadline_ns.
 * Call without the GIL. Returns KT_OK, KT_ETIMEOUT, KT_EPEER_DIED, KT_EPEER_RESTARTED, KT_ESYS. */
static inline int kt_wait(kt_wait_args *a) {
    kt_header *h = (kt_header *)a->map->base;
    _Atomic uint32_t *sleeping = a->is_producer ? &h->producer_sleeping : &h->consumer_sleeping;
    uint64_t start = kt_now_ns();
    uint64_t spin_until = start + a->spin_ns;
    uint64_t next_peer_check = start;
    uint32_t n = 0;
    for (;;) {
        if (kt_check(a)) return KT_OK;
        if ((++n % KT_SPIN_CLOCK_EVERY) != 0 && a->spin_ns) {
            KT_CPU_RELAX();
            continue;
        }
        uint64_t now = kt_now_ns();
        if (now >= next_peer_check) {
            int st = kt_check_peer(a, now);
            if (st != KT_OK) {
                if (kt_check(a)) return KT_OK; /* a reply that landed before the peer died */
                return st;
            }
            next_peer_check = now + 1000000ULL; /* 1 ms */
        }
        if (now >= a->deadline_ns) return kt_check(a) ? KT_OK : KT_ETIMEOUT;
        if (now < spin_until) {
            KT_CPU_RELAX();
            continue;
        }
        /* blocking phase */
        atomic_store_explicit(sleeping, 1, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        if (kt_check(a)) {
            atomic_store_explicit(sleeping, 0, memory_order_relaxed);
            return KT_OK;
        }
        uint64_t until = now + KT_BLOCK_SLICE_NS;
        if (until > a->deadline_ns) until = a->deadline_ns;
        /* sem_clockwait would take CLOCK_MONOTONIC directly; sem_timedwait wants REALTIME. */
        struct timespec rt;
        clock_gettime(CLOCK_REALTIME, &rt);
        uint64_t wait_ns = until > now ? until - now : 0;
        uint64_t abs_ns = (uint64_t)rt.tv_sec * 1000000000ULL + (uint64_t)rt.tv_nsec + wait_ns;
        struct timespec ts = {(time_t)(abs_ns / 1000000000ULL), (long)(abs_ns % 1000000000ULL)};
        int rc = sem_timedwait(a->sem, &ts);
        atomic_store_explicit(sleeping, 0, memory_order_relaxed);
        if (rc != 0 && errno != ETIMEDOUT && errno != EINTR) return KT_ESYS;
        next_peer_check = 0; /* after a sleep, look at the peer straight away */
    }
}

/* The host's side of one device step over n device channels: wait for channels[0]'s
 * device_done while waking consumers that sleep on a posted bell (the device cannot post a
 * semaphore) and watching their heartbeats. With fail set, answer every posted bell with an
 * error reply instead (the consumer is gone for good: the device must still get through the
 * step). Returns KT_OK, KT_EREMOTE (a slot's reply carries an error; found_* say which),
 * KT_EPEER_DIED / KT_EPEER_RESTARTED (found_channel), or KT_ETIMEOUT. With until_called set it
 * returns KT_OK (called = 1) as soon as every channel has a call of the step (posted, its
 * consumer woken, or taken), spinning meanwhile: the host has other work before the rest of
 * the step's wait, and a consumer that slept across the step's end must not wait for it. */
typedef struct {
    const kt_map **maps;
    sem_t **sems; /* each channel's request semaphore */
    uint32_t *epochs; /* the consumer epoch each channel's producer knows */
    uint32_t n;
    uint64_t deadline_ns;
    uint64_t peer_timeout_ns;
    int fail;
    int32_t fail_status;
    uint32_t found_channel;
    uint32_t found_slot;
    int until_called;
    int called;
} kt_step_args;

#define KT_STEP_SPIN_NS 20000ULL /* then poll every KT_STEP_POLL_NS, leaving the core */
#define KT_STEP_POLL_NS 20000L

static inline int kt_wait_step(kt_step_args *a) {
    _Atomic uint32_t *done = &((kt_header *)a->maps[0]->base)->device_done;
    uint64_t next_check = 0;
    uint64_t spin_until = kt_now_ns() + KT_STEP_SPIN_NS;
    uint32_t n = 0;
    for (;;) {
        if (atomic_load_explicit(done, memory_order_acquire)) {
            for (uint32_t c = 0; c < a->n; c++) {
                for (uint32_t i = 0; i < a->maps[c]->num_slots; i++) {
                    if (kt_slot(a->maps[c], i)->reply.status != KT_OK) {
                        a->found_channel = c;
                        a->found_slot = i;
                        return KT_EREMOTE;
                    }
                }
            }
            return KT_OK;
        }
        uint32_t calling = 0; /* channels with a call of this step */
        for (uint32_t c = 0; c < a->n; c++) {
            kt_header *h = (kt_header *)a->maps[c]->base;
            for (uint32_t i = 0; i < a->maps[c]->num_slots; i++) {
                kt_slot_header *s = kt_slot(a->maps[c], i);
                uint32_t bell = atomic_load_explicit(&s->request_bell, memory_order_acquire);
                if (a->until_called && (bell != KT_BELL_IDLE ||
                                        atomic_load_explicit(&s->reply_bell, memory_order_acquire))) {
                    calling++;
                    if (bell == KT_BELL_POSTED) kt_notify(&h->consumer_sleeping, a->sems[c]);
                    break;
                }
                if (bell != KT_BELL_POSTED)
                    continue;
                if (!a->fail) {
                    kt_notify(&h->consumer_sleeping, a->sems[c]);
                    break;
                }
                uint32_t posted = KT_BELL_POSTED;
                if (!atomic_compare_exchange_strong(&s->request_bell, &posted, KT_BELL_CLAIMED))
                    continue;
                s->reply.status = a->fail_status;
                s->reply.num_arrays = 0;
                s->reply.message_len = 0;
                atomic_store_explicit(&s->reply_bell, 1, memory_order_release);
            }
        }
        if (a->until_called && calling == a->n) {
            a->called = 1;
            return KT_OK;
        }
        if ((++n % KT_SPIN_CLOCK_EVERY) != 0) {
            KT_CPU_RELAX();
            continue;
        }
        uint64_t now = kt_now_ns();
        if (now >= a->deadline_ns) return KT_ETIMEOUT;
        if (!a->fail && now >= next_check) {
            for (uint32_t c = 0; c < a->n; c++) {
                kt_wait_args peer = {0};
                peer.map = a->maps[c];
                peer.is_producer = 1;
                peer.known_epoch = a->epochs[c];
                peer.peer_timeout_ns = a->peer_timeout_ns;
                int st = kt_check_peer(&peer, now);
                if (st != KT_OK) {
                    a->found_channel = c;
                    return st;
                }
            }
            next_check = now + 1000000ULL; /* 1 ms */
        }
        /* NOTE: a step lasts milliseconds and the consumers spin between its calls: the host
         * only has to see the end, and the rare sleeping consumer, within a poll period; the
         * core goes to the consumers' kernel threads meanwhile. */
        if (now >= spin_until && !a->until_called) {
            struct timespec ts = {0, KT_STEP_POLL_NS};
            nanosleep(&ts, NULL);
        }
    }
}

/* Consumer attach: a new epoch supersedes any earlier consumer; returns the new epoch. */
static inline uint32_t kt_attach_consumer(void *base, uint32_t pid) {
    kt_header *h = (kt_header *)base;
    uint32_t epoch = atomic_fetch_add_explicit(&h->epoch, 1, memory_order_acq_rel) + 1;
    atomic_store_explicit(&h->consumer_pid, pid, memory_order_release);
    atomic_store_explicit(&h->consumer_heartbeat_ns, kt_now_ns(), memory_order_release);
    return epoch;
}

/* Consumer detach: only the current consumer clears the peer fields. */
static inline void kt_detach_consumer(void *base, uint32_t epoch) {
    kt_header *h = (kt_header *)base;
    if (atomic_load_explicit(&h->epoch, memory_order_acquire) != epoch) return;
    atomic_store_explicit(&h->consumer_heartbeat_ns, 0, memory_order_release);
    atomic_store_explicit(&h->consumer_pid, 0, memory_order_release);
}

static inline uint32_t kt_current_epoch(void *base) {
    return atomic_load_explicit(&((kt_header *)base)->epoch, memory_order_acquire);
}

static inline uint64_t kt_heartbeat_age_ns(_Atomic uint64_t *slot) {
    uint64_t hb = atomic_load_explicit(slot, memory_order_acquire);
    uint64_t now = kt_now_ns();
    if (hb == 0) return UINT64_MAX;
    return now > hb ? now - hb : 0;
}

/* Heartbeat: a pthread stores CLOCK_MONOTONIC into *slot every period_ns until stopped. It does
 * not touch the GIL, so a Python thread busy for seconds cannot make a live peer look dead. */
typedef struct {
    _Atomic uint64_t *slot;
    uint64_t period_ns;
    _Atomic int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int running;
} kt_heartbeat;

static void *kt_heartbeat_main(void *arg) {
    kt_heartbeat *hb = (kt_heartbeat *)arg;
    pthread_mutex_lock(&hb->mu);
    while (!atomic_load(&hb->stop)) {
        atomic_store_explicit(hb->slot, kt_now_ns(), memory_order_release);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t abs_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec + hb->period_ns;
        ts.tv_sec = (time_t)(abs_ns / 1000000000ULL);
        ts.tv_nsec = (long)(abs_ns % 1000000000ULL);
        pthread_cond_timedwait(&hb->cv, &hb->mu, &ts);
    }
    pthread_mutex_unlock(&hb->mu);
    return NULL;
}

static inline int kt_heartbeat_start(kt_heartbeat *hb, _Atomic uint64_t *slot, uint64_t period_ns) {
    hb->slot = slot;
    hb->period_ns = period_ns;
    atomic_store(&hb->stop, 0);
    pthread_mutex_init(&hb->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&hb->cv, &attr);
    pthread_condattr_destroy(&attr);
    atomic_store_explicit(slot, kt_now_ns(), memory_order_release);
    int rc = pthread_create(&hb->thread, NULL, kt_heartbeat_main, hb);
    hb->running = rc == 0;
    return rc;
}

static inline void kt_heartbeat_stop(kt_heartbeat *hb) {
    if (!hb->running) return;
    pthread_mutex_lock(&hb->mu);
    atomic_store(&hb->stop, 1);
    pthread_cond_signal(&hb->cv);
    pthread_mutex_unlock(&hb->mu);
    pthread_join(hb->thread, NULL);
    pthread_mutex_destroy(&hb->mu);
    pthread_cond_destroy(&hb->cv);
    hb->running = 0;
}

#endif /* KTSHM_H */
