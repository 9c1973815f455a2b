# cython: language_level=3
"""Thin Cython layer over ktk.h: raw addresses in, status codes turned into exceptions here."""

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from libc.stdint cimport int8_t, int32_t, int64_t, uint64_t, uintptr_t


cdef extern from "ktk.h":
    enum:
        KTK_OK
        KTK_ERR_BAD_ID
        KTK_ERR_NOMEM
        KTK_ERR_BAD_ISA
        KTK_ERR_BAD_ARG

    ctypedef struct ktk_pack_args:
        int fmt, E, H, I, src_dtype, num_threads
        const void* gate
        const void* up
        const void* down
        const void* const* gate_e
        const void* const* up_e
        const void* const* down_e
        const float* const* gate_s
        const float* const* up_s
        const float* const* down_s
        int block_rows, block_cols
        void* w13
        void* w2
        void* s13
        void* s2
        int32_t* r13
        int32_t* r2

    ctypedef struct ktk_kernel:
        pass

    ctypedef struct ktk_forward_args:
        int fmt, E, H, I
        const void* w13
        const void* w2
        const void* s13
        const void* s2
        const int32_t* r13
        const int32_t* r2
        int T, k
        const void* x
        int x_dtype
        const int32_t* ids
        const float* weights
        void* out
        int out_dtype
        int64_t* expert_counts

    int ktk_isa_supported(int isa) nogil
    int ktk_pack(const ktk_pack_args* a) nogil
    ktk_kernel* ktk_kernel_create(int num_threads, int isa, int pin) nogil
    void ktk_kernel_destroy(ktk_kernel* kern) nogil
    int ktk_forward(ktk_kernel* kern, const ktk_forward_args* a) nogil
    void ktk_last_forward(const ktk_kernel* kern, int64_t* start_ns, int64_t* end_ns,
                          int* experts) nogil
    void ktk_kernel_wake(ktk_kernel* kern) nogil
    enum:
        KTK_MARKS
    int ktk_last_marks(const ktk_kernel* kern, int64_t* out, int cap) nogil
    int ktk_quantize_int8(int isa, const void* src, int src_dtype, int n_real, int n_pad,
                          int8_t* dst, float* scale, int32_t* gsum) nogil
    int ktk_stream_read(ktk_kernel* kern, const void* buf, size_t nbytes, uint64_t* xor_out) nogil


MARKS = KTK_MARKS  # phase marks per pool thread (ktk_last_marks)


cdef struct _Buf:
    void* ptr
    char kind  # the buffer's struct format letter: f (float32), H (uint16: bf16), i, q, ...
    int ndim
    Py_ssize_t rows, cols


cdef bint _buffer(object obj, _Buf* b, bint writable):
    """A C-contiguous buffer's address, format letter and first two dims; False if obj is
    not one (NOTE: released at once: the caller holds obj for the call)."""
    cdef Py_buffer view
    cdef int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (PyBUF_WRITABLE if writable else 0)
    try:
        PyObject_GetBuffer(obj, &view, flags)
    except (BufferError, TypeError, ValueError):
        return False
    cdef const char* f = view.format
    if f[0] in (b"<", b"=", b"@"):
        f += 1
    b.kind = f[0] if f[1] == 0 else 0
    if b.kind == b"l" and view.itemsize == 8:
        b.kind = b"q"
    if b.kind == b"l" and view.itemsize == 4:
        b.kind = b"i"
    b.ptr = view.buf
    b.ndim = view.ndim
    b.rows = view.shape[0] if view.ndim > 0 else 0
    b.cols = view.shape[1] if view.ndim > 1 else 0
    PyBuffer_Release(&view)
    return True


cdef int _check(int status) except -1:
    if status == KTK_OK:
        return 0
    if status == KTK_ERR_BAD_ID:
        raise ValueError("ids must be -1 or in [0, num_experts)")
    if status == KTK_ERR_NOMEM:
        raise MemoryError("kernel scratch allocation failed")
    if status == KTK_ERR_BAD_ISA:
        raise RuntimeError("instruction set not supported on this CPU")
    raise ValueError(f"bad kernel argument (status {status})")


def isa_supported(int isa) -> bool:
    return bool(ktk_isa_supported(isa))


def quantize_int8(int isa, uintptr_t src, int src_dtype, int n_real, int n_pad, uintptr_t dst,
                  uintptr_t scale, uintptr_t gsum) -> None:
    """One activation row quantized to int8 as a forward call does it (isa -1: the scalar
    reference); raw addresses, sizes checked by the caller."""
    cdef int status
    with nogil:
        status = ktk_quantize_int8(isa, <const void*>src, src_dtype, n_real, n_pad,
                                   <int8_t*>dst, <float*>scale, <int32_t*>gsum)
    _check(status)


def pack(int fmt, int E, int H, int I, int src_dtype, uintptr_t gate, uintptr_t up,
         uintptr_t down, uintptr_t w13, uintptr_t w2, uintptr_t s13, uintptr_t s2,
         uintptr_t r13, uintptr_t r2, int num_threads, uintptr_t gate_e=0, uintptr_t up_e=0,
         uintptr_t down_e=0, uintptr_t gate_s=0, uintptr_t up_s=0, uintptr_t down_s=0,
         int block_rows=0, int block_cols=0) -> None:
    """gate_e .. down_s: addresses of arrays of E pointers (per-expert sources, their scales)."""
    cdef ktk_pack_args a
    a.fmt = fmt
    a.E = E
    a.H = H
    a.I = I
    a.src_dtype = src_dtype
    a.num_threads = num_threads
    a.gate = <const void*>gate
    a.up = <const void*>up
    a.down = <const void*>down
    a.gate_e = <const void* const*>gate_e
    a.up_e = <const void* const*>up_e
    a.down_e = <const void* const*>down_e
    a.gate_s = <const float* const*>gate_s
    a.up_s = <const float* const*>up_s
    a.down_s = <const float* const*>down_s
    a.block_rows = block_rows
    a.block_cols = block_cols
    a.w13 = <void*>w13
    a.w2 = <void*>w2
    a.s13 = <void*>s13
    a.s2 = <void*>s2
    a.r13 = <int32_t*>r13
    a.r2 = <int32_t*>r2
    cdef int status
    with nogil:
        status = ktk_pack(&a)
    _check(status)


cdef void _set_weights(ktk_forward_args* a, int fmt, int E, int H, int I, uintptr_t w13,
                       uintptr_t w2, uintptr_t s13, uintptr_t s2, uintptr_t r13,
                       uintptr_t r2):
    """The packed experts' part of a forward's arguments (both entry points share it)."""
    a.fmt = fmt
    a.E = E
    a.H = H
    a.I = I
    a.w13 = <const void*>w13
    a.w2 = <const void*>w2
    a.s13 = <const void*>s13
    a.s2 = <const void*>s2
    a.r13 = <const int32_t*>r13
    a.r2 = <const int32_t*>r2


cdef class Kernel:
    """Owns the C kernel (thread pool + scratch). Not thread-safe: one call at a time."""

    cdef ktk_kernel* _k

    def __cinit__(self, int num_threads, int isa, bint pin):
        self._k = ktk_kernel_create(num_threads, isa, pin)
        if self._k == NULL:
            raise RuntimeError("instruction set not supported on this CPU")

    def close(self) -> None:
        if self._k != NULL:
            ktk_kernel_destroy(self._k)
            self._k = NULL

    def __dealloc__(self):
        self.close()

    def forward(self, int fmt, int E, int H, int I, uintptr_t w13, uintptr_t w2, uintptr_t s13,
                uintptr_t s2, uintptr_t r13, uintptr_t r2, int T, int k, uintptr_t x,
                int x_dtype, uintptr_t ids, uintptr_t weights, uintptr_t out,
                int out_dtype) -> None:
        if self._k == NULL:
            raise RuntimeError("kernel is closed")
        cdef ktk_forward_args a
        _set_weights(&a, fmt, E, H, I, w13, w2, s13, s2, r13, r2)
        a.T = T
        a.k = k
        a.x = <const void*>x
        a.x_dtype = x_dtype
        a.ids = <const int32_t*>ids
        a.weights = <const float*>weights
        a.out = <void*>out
        a.out_dtype = out_dtype
        a.expert_counts = NULL
        cdef int status
        with nogil:
            status = ktk_forward(self._k, &a)
        _check(status)

    def forward_arrays(self, int fmt, int E, int H, int I, uintptr_t w13, uintptr_t w2,
                       uintptr_t s13, uintptr_t s2, uintptr_t r13, uintptr_t r2, object x,
                       object ids, object weights, object out, object expert_counts) -> bool:
        """forward() on buffers (numpy arrays): x [T,H] f32/bf16 (uint16), ids [T,k] int32,
        weights [T,k] f32, out [T,H] f32/bf16, expert_counts None or [E] int64 (writable).
        False, with nothing run, when an argument is not such a buffer (the caller's checks
        then say what is wrong); kernel errors raise."""
        if self._k == NULL:
            raise RuntimeError("kernel is closed")
        cdef _Buf bx, bids, bw, bout, bcounts
        if not (_buffer(x, &bx, 0) and _buffer(ids, &bids, 0) and _buffer(weights, &bw, 0)
                and _buffer(out, &bout, 1)):
            return False
        bcounts.ptr = NULL
        if expert_counts is not None:
            if not _buffer(expert_counts, &bcounts, 1) or bcounts.kind != b"q":
                return False
            if bcounts.ndim != 1 or bcounts.rows != E:
                return False
        if (bx.ndim != 2 or bx.cols != H or bids.ndim != 2 or bids.rows != bx.rows
                or bw.ndim != 2 or bw.rows != bx.rows or bw.cols != bids.cols
                or bout.ndim != 2 or bout.rows != bx.rows or bout.cols != H
                or bids.kind != b"i" or bw.kind != b"f"
                or (bx.kind != b"f" and bx.kind != b"H") or (bout.kind != b"f" and bout.kind != b"H")):
            return False
        cdef ktk_forward_args a
        _set_weights(&a, fmt, E, H, I, w13, w2, s13, s2, r13, r2)
        a.T = <int>bx.rows
        a.k = <int>bids.cols
        a.x = bx.ptr
        a.x_dtype = 0 if bx.kind == b"f" else 1
        a.ids = <const int32_t*>bids.ptr
        a.weights = <const float*>bw.ptr
        a.out = bout.ptr
        a.out_dtype = 0 if bout.kind == b"f" else 1
        a.expert_counts = <int64_t*>bcounts.ptr
        cdef int status
        with nogil:
            status = ktk_forward(self._k, &a)
        _check(status)
        return True

    def last_forward(self) -> tuple:
        cdef int64_t start = 0, end = 0
        cdef int experts = 0
        if self._k != NULL:
            ktk_last_forward(self._k, &start, &end, &experts)
        return start, end, experts

    def last_marks(self, uintptr_t out, int cap) -> int:
        """Writes the last call's phase marks ([threads][MARKS] int64) to out (cap values at
        most); returns the thread count (0 once closed)."""
        if self._k == NULL:
            return 0
        return ktk_last_marks(self._k, <int64_t*>out, cap)

    def wake(self) -> None:
        if self._k != NULL:
            with nogil:
                ktk_kernel_wake(self._k)

    def stream_read(self, uintptr_t buf, size_t nbytes) -> int:
        if self._k == NULL:
            raise RuntimeError("kernel is closed")
        cdef uint64_t result = 0
        cdef int status
        with nogil:
            status = ktk_stream_read(self._k, <const void*>buf, nbytes, &result)
        _check(status)
        return result
