# Mirror of ktshm.h: the layout, the status table and the hot-path functions.
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    sem_t* sem_open(const char* name, int oflag, ...)
    int sem_close(sem_t* sem)
    int sem_post(sem_t* sem)
    sem_t* SEM_FAILED


cdef extern from "ktshm.h" nogil:
    uint64_t KT_MAGIC
    uint32_t KT_LAYOUT_VERSION
    uint32_t KT_HEADER_BYTES
    uint32_t KT_SLOT_HEADER_BYTES
    uint32_t KT_REGION_ALIGN
    uint32_t KT_ARRAY_ALIGN
    uint32_t KT_MAX_ARRAYS
    uint32_t KT_MAX_DIMS
    uint32_t KT_FLAG_DEVICE

    enum kt_status:
        KT_OK
        KT_ETIMEOUT
        KT_EPEER_DIED
        KT_EPEER_RESTARTED
        KT_EBADMSG
        KT_ETOOLARGE
        KT_EREMOTE
        KT_ESYS

    enum kt_slot_state:
        KT_SLOT_FREE
        KT_SLOT_REQUEST
        KT_SLOT_BUSY
        KT_SLOT_REPLY

    enum kt_bell:
        KT_BELL_IDLE
        KT_BELL_POSTED
        KT_BELL_CLAIMED

    ctypedef struct kt_array_meta:
        uint8_t dtype
        uint8_t ndim
        uint32_t shape[4]
        uint64_t offset
        uint64_t nbytes

    ctypedef struct kt_meta:
        uint32_t kind
        uint32_t layer
        uint32_t num_tokens
        int32_t status
        uint32_t num_arrays
        uint32_t message_len
        kt_array_meta arrays[4]

    ctypedef struct kt_slot_header:
        uint64_t word
        uint64_t seq
        uint32_t epoch
        kt_meta request
        kt_meta reply
        uint32_t request_bell
        uint32_t reply_bell
        uint64_t request_ns

    ctypedef struct kt_header:
        uint64_t magic
        uint32_t layout_version
        uint32_t num_slots
        uint64_t region_bytes
        uint64_t slot_stride
        uint32_t creator_pid
        uint32_t flags
        uint64_t created_ns
        uint64_t producer_heartbeat_ns
        uint64_t consumer_heartbeat_ns
        uint32_t consumer_pid
        uint32_t epoch
        uint32_t producer_sleeping
        uint32_t consumer_sleeping
        uint32_t device_done

    ctypedef struct kt_map:
        void* base
        uint32_t num_slots
        uint64_t stride
        uint64_t region

    ctypedef struct kt_wait_args:
        const kt_map* map
        int is_producer
        int device
        uint32_t* bell
        uint32_t bell_value
        uint32_t slot_index
        uint64_t expect_word
        uint32_t known_epoch
        uint64_t spin_ns
        uint64_t deadline_ns
        uint64_t peer_timeout_ns
        sem_t* sem
        uint32_t found_index
        uint64_t found_word

    ctypedef struct kt_step_args:
        const kt_map** maps
        sem_t** sems
        uint32_t* epochs
        uint32_t n
        uint64_t deadline_ns
        uint64_t peer_timeout_ns
        int fail
        int32_t fail_status
        uint32_t found_channel
        uint32_t found_slot
        int until_called
        int called

    ctypedef struct kt_heartbeat:
        pass

    uint64_t kt_word(uint64_t seq, uint32_t epoch, uint32_t state)
    uint32_t kt_word_state(uint64_t w)
    uint32_t kt_word_epoch(uint64_t w)
    uint32_t kt_word_seq32(uint64_t w)
    uint64_t kt_now_ns()
    kt_slot_header* kt_slot(const kt_map* m, uint32_t index)
    uint64_t kt_load_acquire(uint64_t* p)
    void kt_store_release(uint64_t* p, uint64_t v)
    int kt_cas(uint64_t* p, uint64_t expected, uint64_t desired)
    void kt_notify(uint32_t* sleeping, sem_t* sem)
    int kt_wait(kt_wait_args* a)
    int kt_wait_step(kt_step_args* a)
    uint32_t kt_bell_load(uint32_t* p)
    void kt_bell_store(uint32_t* p, uint32_t v)
    int kt_bell_cas(uint32_t* p, uint32_t expected, uint32_t desired)
    uint32_t kt_attach_consumer(void* base, uint32_t pid)
    void kt_detach_consumer(void* base, uint32_t epoch)
    uint32_t kt_current_epoch(void* base)
    uint64_t kt_heartbeat_age_ns(uint64_t* slot)
    int kt_heartbeat_start(kt_heartbeat* hb, uint64_t* slot, uint64_t period_ns)
    void kt_heartbeat_stop(kt_heartbeat* hb)
