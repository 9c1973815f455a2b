# cython: language_level=3, boundscheck=False, wraparound=False
"""ktshm: a request/response channel in POSIX shared memory between one producer and one consumer.

The producer (the GPU service) creates the channel; the consumer (an expert worker) attaches to
it by name. Requests and replies carry up to four arrays each, written straight into the segment:
the arrays handed out by `begin`/`recv`/`recv_request` are numpy views on it (zero copy).

Segment layout (offsets in bytes; all integers little-endian)::

    0       header (4096): magic "KKTSHM1", layout version, num_slots, region_bytes, slot_stride,
            creator pid, created_ns, then one cache line each for: producer heartbeat (ns),
            consumer heartbeat + consumer pid + epoch, producer_sleeping, consumer_sleeping
    4096    slot 0: slot header (512) | request region (region_bytes) | reply region (region_bytes)
    +stride slot 1 ...
    slot header: word (own cache line) | seq | epoch stamp | request kt_meta | reply kt_meta
    kt_meta: kind, layer, num_tokens, status, num_arrays, message_len,
             4 x (dtype, ndim, shape[4], offset, nbytes)

Slot state machine; the word is [seq low 32 | epoch 16 | state 16]::

            producer: commit (store-release)          consumer: CAS (acq_rel)
      FREE ───────────────────────────────▶ REQUEST ─────────────────────────▶ BUSY
       ▲                                     ▲  │                                │
       │ producer: release after recv       │  │ producer: abandon (CAS)        │ consumer:
       │ (store-release)                     │  ▼                                │ CAS -> REPLY
       └──────────────────── REPLY ◀─────────┼──┴────────────────────────────────┘
                                             │
                  producer: resend_inflight re-stamps REQUEST/BUSY slots with the new epoch

NOTE: every slot field other than the word is written before a store-release (or successful
CAS) of the word and read after a load-acquire of it; a plain store there is a known bug in
similar rings (the payload may become visible after the state). Because the word carries seq and
epoch, a consumer that was declared dead cannot publish over a slot that has since been resent or
reused: its CAS fails and its reply is discarded.

Waiting: spin for `spin_us`, then set the `*_sleeping` flag and block on a named POSIX semaphore
(`<name>.req` wakes the consumer, `<name>.rep` the producer), re-checking the peer's heartbeat at
least every 20 ms. Each side stamps its heartbeat from a pthread (no GIL involved) every
`heartbeat_period_s`; a peer whose stamp is older than `peer_timeout_s` is dead. A consumer that
attaches bumps the epoch; the producer's waits then raise PeerRestarted, and `resend_inflight()`
re-stamps what was in flight so the new consumer runs it.

Device channels (``Channel.create(device=True)``): the producer is a GPU stream, which can only
write and wait for constant 32-bit values. Each slot then carries a request bell and a reply bell
(ktshm.h draws their states) instead of the word; slot i serves one call site (a MoE layer of a
decode step) and holds one call at a time. The host lays out a slot's request metadata with
`device_layout` before it launches the device's work, hands the device the addresses from
`device_slot`, and waits for the step with `wait_device_step`, which wakes sleeping consumers
(a stream cannot post a semaphore) and watches their heartbeats. Consumers serve device
channels through the same recv_request / reply calls as any other.
"""

import atexit
import mmap
import os
import secrets
import time
import weakref

import numpy as np
import posix_ipc

from libc.errno cimport errno
from libc.string cimport memcpy
from libc.stdint cimport int32_t, uint32_t, uint64_t
from posix.fcntl cimport O_CREAT, O_EXCL

from ktshm._ktshm cimport *
from ktshm import errors
from ktshm.config import ChannelConfig

SEGMENT_PREFIX = "ktshm."
# A word the environment may put into every name this process and its children (which inherit it)
# create, after SEGMENT_PREFIX: a test run sets one of its own to tell its segments from those of
# any other ktserve process on the machine.
NAME_TAG_ENV = "KTSHM_NAME_TAG"
_NAME_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_ARRAYS = KT_MAX_ARRAYS
MAX_DIMS = KT_MAX_DIMS

# dtype code -> (name, numpy dtype of the view); bfloat16 travels as uint16 bits.
DTYPES = {
    1: ("float32", np.dtype(np.float32)),
    2: ("bfloat16", np.dtype(np.uint16)),
    3: ("float16", np.dtype(np.float16)),
    4: ("int32", np.dtype(np.int32)),
    5: ("int64", np.dtype(np.int64)),
    6: ("uint8", np.dtype(np.uint8)),
    7: ("int8", np.dtype(np.int8)),
    8: ("uint16", np.dtype(np.uint16)),
    9: ("float64", np.dtype(np.float64)),
}
DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}

_live_channels = weakref.WeakSet()


def _close_all_at_exit():
    for ch in list(_live_channels):
        ch.close()


atexit.register(_close_all_at_exit)


cdef inline uint64_t _align(uint64_t n, uint64_t a):
    return (n + a - 1) // a * a


def name_prefix() -> str:
    """What the names of the channels this process creates start with: SEGMENT_PREFIX, then the
    tag in $KTSHM_NAME_TAG and a dot when it is set (letters, digits, _ and -, at most 32)."""
    tag = os.environ.get(NAME_TAG_ENV, "")
    if not tag:
        return SEGMENT_PREFIX
    if len(tag) > 32 or not _NAME_TAG_CHARS.issuperset(tag):
        raise ValueError(f"{NAME_TAG_ENV}={tag!r}: at most 32 letters, digits, '_' or '-'")
    return f"{SEGMENT_PREFIX}{tag}."


def new_channel_name() -> str:
    """A unique, unguessable channel name for this process and run:
    <name_prefix()><pid>.<64 random bits in hex>."""
    return f"{name_prefix()}{os.getpid()}.{secrets.token_hex(8)}"


def _semaphore_names(str name):
    return f"/{name}.req", f"/{name}.rep"


def _unlink_all(str name):
    for unlink, path in ((posix_ipc.unlink_shared_memory, f"/{name}"),
                         (posix_ipc.unlink_semaphore, _semaphore_names(name)[0]),
                         (posix_ipc.unlink_semaphore, _semaphore_names(name)[1])):
        try:
            unlink(path)
        except posix_ipc.ExistentialError:
            pass


def _dtype_code(str name):
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPE_CODES)}") from None


_NAME_BY_NUMPY_NUM = {dt.num: name for _, (name, dt) in sorted(DTYPES.items())}


def _specs_of(arrays, dtypes):
    """[(shape, wire dtype name)] of arrays about to be written; dtypes may override names."""
    if dtypes is None:
        out = []
        for a in arrays:
            name = _NAME_BY_NUMPY_NUM.get(a.dtype.num)
            if name is None:
                raise ValueError(f"unsupported dtype {a.dtype}; supported: {sorted(DTYPE_CODES)}")
            out.append((a.shape, name))
        return out
    if len(dtypes) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays but {len(dtypes)} dtypes")
    return [(a.shape, dt or _NAME_BY_NUMPY_NUM.get(a.dtype.num, str(a.dtype)))
            for a, dt in zip(arrays, dtypes)]


class Message:
    """One request or reply: metadata plus numpy views on the slot's region. `payload` (requests
    from begin() only, else None): the region up to the last array's end as one uint8 view, with
    the arrays at their offsets, for filling every array with one bulk copy."""

    __slots__ = ("seq", "slot", "kind", "layer", "num_tokens", "status", "arrays", "dtypes",
                 "payload")

    def __init__(self, seq, slot, kind, layer, num_tokens, status, arrays, dtypes, payload=None):
        self.seq = seq
        self.slot = slot
        self.kind = kind
        self.layer = layer
        self.num_tokens = num_tokens
        self.status = status
        self.arrays = arrays
        self.dtypes = dtypes
        self.payload = payload

    def __repr__(self):
        shapes = [tuple(a.shape) for a in self.arrays]
        return (f"Message(seq={self.seq}, kind={self.kind}, layer={self.layer}, "
                f"num_tokens={self.num_tokens}, status={self.status}, arrays={shapes})")


cdef class Channel:
    """One end of a ktshm channel. Build with Channel.create (producer) or Channel.attach."""

    cdef object _mm
    cdef object _region_bytes_view
    cdef const unsigned char[::1] _mv
    cdef void* _base
    cdef kt_map _map         # the geometry, validated once (ktshm.h: kt_map)
    cdef kt_header* _hdr
    cdef sem_t* _sem_req
    cdef sem_t* _sem_rep
    cdef kt_heartbeat _hb
    cdef readonly str name
    cdef readonly bint is_producer
    cdef readonly object config
    cdef readonly uint32_t num_slots
    cdef readonly uint64_t region_bytes
    cdef readonly bint device
    cdef uint64_t _device_calls
    cdef uint32_t _known_epoch
    cdef uint64_t _next_seq
    cdef uint64_t _spin_ns
    cdef uint64_t _peer_timeout_ns
    cdef int _owner_pid
    cdef bint _closed
    # consumer, CLOCK_MONOTONIC ns of its last call (call_stamps): when the producer published
    # the request, when this end first looked for it, found it, and published the reply
    cdef uint64_t _request_ns, _ready_ns, _awake_ns, _published_ns
    cdef bint _took          # consumer: a request was taken since _ready_ns was stamped
    cdef dict _inflight      # producer: seq -> epoch stamp, requests not yet released
    cdef set _abandoned      # producer: seqs given up on while the consumer held them
    # consumer, per slot: (request metadata bytes, arrays, dtype names) and (reply specs,
    # reply metadata bytes, views) of its last call: a call laid out as the last one in that
    # slot (every decode step's) reuses its views instead of building them again
    cdef list _request_layouts
    cdef list _reply_layouts
    cdef object __weakref__

    def __cinit__(self):
        self._sem_req = NULL
        self._sem_rep = NULL
        self._closed = True
        self._base = NULL

    # ----------------------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls, config=None, name=None, cleanup_stale_segments=True, device=False):
        """Create a channel as its producer; the segment and semaphores are owner-only (0600).
        device: a device channel (see the module docstring): slots rung by bells."""
        config = config or ChannelConfig()
        if cleanup_stale_segments:
            cleanup_stale()
        name = name or new_channel_name()
        cdef Channel ch = Channel.__new__(Channel)
        region = _align(config.region_bytes, KT_REGION_ALIGN)
        stride = KT_SLOT_HEADER_BYTES + 2 * region
        total = KT_HEADER_BYTES + config.num_slots * stride
        try:
            shm = posix_ipc.SharedMemory(f"/{name}", posix_ipc.O_CREX, mode=0o600, size=total)
        except posix_ipc.ExistentialError:
            raise errors.KtshmError(f"channel {name!r} already exists") from None
        try:
            mm = mmap.mmap(shm.fd, total)
        finally:
            shm.close_fd()
        ch._setup(name, mm, config, is_producer=True)
        try:
            ch._init_header(config.num_slots, region, stride, KT_FLAG_DEVICE if device else 0)
            ch._open_semaphores(create=True)
            ch._next_seq = 0
            ch._known_epoch = 0
            if kt_heartbeat_start(&ch._hb, &ch._hdr.producer_heartbeat_ns,
                                  <uint64_t>(config.heartbeat_period_s * 1e9)) != 0:
                raise errors.KtshmError("could not start the heartbeat thread")
        except BaseException:
            ch.close()
            raise
        return ch

    @classmethod
    def attach(cls, name, config=None, force=False):
        """Attach to an existing channel as its consumer (a new epoch: earlier ones are stale).

        A live consumer (fresh heartbeat) makes this raise ChannelBusy unless force is set.
        """
        config = config or ChannelConfig()
        try:
            shm = posix_ipc.SharedMemory(f"/{name}")
        except posix_ipc.ExistentialError:
            raise errors.ChannelNotFound(f"no ktshm channel named {name!r}") from None
        try:
            st = os.fstat(shm.fd)
            size = st.st_size
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise errors.UntrustedSegment(
                    f"segment {name!r} is owned by uid {st.st_uid} with mode "
                    f"{st.st_mode & 0o777:o}; a consumer attaches only to segments of its own "
                    f"uid ({os.geteuid()}) that no one else can open (0600)")
            if size < KT_HEADER_BYTES:
                raise errors.LayoutMismatch(
                    f"segment {name!r} is {size} bytes, smaller than a ktshm header")
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        cdef Channel ch = Channel.__new__(Channel)
        ch._setup(name, mm, config, is_producer=False)
        try:
            ch._validate_header(size)
            if not force:
                ch._wait_consumer_gone()
            ch._open_semaphores(create=False)
            ch._known_epoch = kt_attach_consumer(ch._base, os.getpid())
            if kt_heartbeat_start(&ch._hb, &ch._hdr.consumer_heartbeat_ns,
                                  <uint64_t>(config.heartbeat_period_s * 1e9)) != 0:
                raise errors.KtshmError("could not start the heartbeat thread")
        except BaseException:
            ch.close()
            raise
        # Wake a producer that may be blocked waiting for a reply: it will see the new epoch.
        kt_notify(&ch._hdr.producer_sleeping, ch._sem_rep)
        return ch

    cdef _wait_consumer_gone(self):
        """Give an attached consumer one peer timeout to show it is alive (a worker restarted
        right after a crash finds its predecessor's heartbeat still fresh); then ChannelBusy."""
        deadline = time.monotonic() + self.config.peer_timeout_s
        while (self._hdr.consumer_pid != 0
               and kt_heartbeat_age_ns(&self._hdr.consumer_heartbeat_ns) < self._peer_timeout_ns):
            if time.monotonic() >= deadline:
                raise errors.ChannelBusy(
                    f"channel {self.name!r} already has a live consumer "
                    f"(pid {self._hdr.consumer_pid}); detach it first or attach with force")
            time.sleep(0.001)

    cdef _setup(self, str name, object mm, object config, bint is_producer):
        self._mm = mm
        self._mv = mm
        self._base = <void*>&self._mv[0]
        self._map.base = self._base
        self._map.num_slots = 0  # NOTE: no slot is addressable before the header is validated
        self._hdr = <kt_header*>self._base
        self.name = name
        self.is_producer = is_producer
        self.config = config
        self._spin_ns = <uint64_t>(config.spin_us * 1e3)
        self._peer_timeout_ns = <uint64_t>(config.peer_timeout_s * 1e9)
        self._owner_pid = os.getpid()
        self._inflight = {}
        self._abandoned = set()
        self._request_layouts = []
        self._reply_layouts = []
        self._closed = False
        _live_channels.add(self)

    cdef _init_header(self, uint32_t num_slots, uint64_t region, uint64_t stride,
                      uint32_t flags):
        self._hdr.layout_version = KT_LAYOUT_VERSION
        self._hdr.flags = flags
        self.device = (flags & KT_FLAG_DEVICE) != 0
        self._hdr.num_slots = num_slots
        self._hdr.region_bytes = region
        self._hdr.slot_stride = stride
        self._hdr.creator_pid = os.getpid()
        self._hdr.created_ns = kt_now_ns()
        self._hdr.magic = KT_MAGIC
        self.num_slots = num_slots
        self.region_bytes = region
        self._map.num_slots, self._map.stride, self._map.region = num_slots, stride, region

    cdef _validate_header(self, uint64_t size):
        if self._hdr.magic != KT_MAGIC:
            raise errors.LayoutMismatch(
                f"segment {self.name!r} is not a ktshm channel (magic {self._hdr.magic:#x})")
        if self._hdr.layout_version != KT_LAYOUT_VERSION:
            raise errors.LayoutMismatch(
                f"channel {self.name!r} has layout version {self._hdr.layout_version}, "
                f"this build speaks {KT_LAYOUT_VERSION}")
        n, region, stride = self._hdr.num_slots, self._hdr.region_bytes, self._hdr.slot_stride
        if (n == 0 or stride != KT_SLOT_HEADER_BYTES + 2 * region
                or KT_HEADER_BYTES + n * stride != size):
            raise errors.LayoutMismatch(
                f"channel {self.name!r} header is inconsistent: {n} slots of {region} bytes, "
                f"stride {stride}, segment {size} bytes")
        flags = self._hdr.flags
        if flags & ~KT_FLAG_DEVICE:
            raise errors.LayoutMismatch(
                f"channel {self.name!r} has unknown header flags {flags:#x}")
        self.num_slots = n
        self.region_bytes = region
        self._map.num_slots, self._map.stride, self._map.region = n, stride, region
        self.device = (flags & KT_FLAG_DEVICE) != 0

    cdef _open_semaphores(self, bint create):
        req, rep = _semaphore_names(self.name)
        cdef int flags = (O_CREAT | O_EXCL) if create else 0
        cdef bytes breq = req.encode(), brep = rep.encode()
        self._sem_req = sem_open(breq, flags, <int>0o600, <unsigned int>0)
        if self._sem_req == SEM_FAILED:
            self._sem_req = NULL
            raise errors.ChannelNotFound(f"semaphore {req!r}: {os.strerror(errno)}")
        self._sem_rep = sem_open(brep, flags, <int>0o600, <unsigned int>0)
        if self._sem_rep == SEM_FAILED:
            self._sem_rep = NULL
            raise errors.ChannelNotFound(f"semaphore {rep!r}: {os.strerror(errno)}")

    def close(self):
        """Stop the heartbeat and unmap; the producer also unlinks the segment and semaphores."""
        if self._closed:
            return
        self._closed = True
        _live_channels.discard(self)
        kt_heartbeat_stop(&self._hb)
        if self._owner_pid == os.getpid() and self._base != NULL:
            if self.is_producer:
                self._hdr.producer_heartbeat_ns = 0
            elif self._known_epoch:
                kt_detach_consumer(self._base, self._known_epoch)
                kt_notify(&self._hdr.producer_sleeping, self._sem_rep)
        if self._sem_req != NULL:
            sem_close(self._sem_req)
            self._sem_req = NULL
        if self._sem_rep != NULL:
            sem_close(self._sem_rep)
            self._sem_rep = NULL
        self._base = NULL
        self._hdr = NULL
        self._request_layouts = []  # NOTE: their views hold the mapping open
        self._reply_layouts = []
        self._mv = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes when they do
        if self.is_producer and self._owner_pid == os.getpid():
            _unlink_all(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        kt_heartbeat_stop(&self._hb)
        # NOTE: a producer dropped without close() (an exception between create() and its
        # owner keeping it) still removes its names; the mapping goes with the mmap object.
        if not self._closed and self.is_producer and self._owner_pid == os.getpid():
            _unlink_all(self.name)

    @property
    def closed(self):
        return self._closed

    @property
    def address(self):
        """Address of the mapped segment in this process (e.g. for cudaHostRegister)."""
        self._check_open()
        return <size_t>self._base

    @property
    def size(self):
        """Bytes of the mapped segment."""
        self._check_open()
        return len(self._mm)

    @property
    def epoch(self):
        """The epoch this end works in (consumer: the one it attached as)."""
        return self._known_epoch

    def unlink_if_producer_gone(self, wait_s=0.0):
        """Consumer: when the producer is gone (its heartbeat older than peer_timeout_s, waited
        for up to wait_s), unlink the segment and semaphores it can no longer unlink itself (a
        killed GPU service's segments would otherwise stay in RAM until the next start).
        Returns True if it unlinked them."""
        self._check_open()
        if self.is_producer:
            raise errors.KtshmError("unlink_if_producer_gone() is the consumer's")
        deadline = time.monotonic() + wait_s
        while kt_heartbeat_age_ns(&self._hdr.producer_heartbeat_ns) < self._peer_timeout_ns:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        _unlink_all(self.name)
        return True

    def peer_alive(self):
        """True when the other side's heartbeat is fresh."""
        self._check_open()
        if self.is_producer:
            return kt_heartbeat_age_ns(&self._hdr.consumer_heartbeat_ns) < self._peer_timeout_ns
        return kt_heartbeat_age_ns(&self._hdr.producer_heartbeat_ns) < self._peer_timeout_ns

    cdef _check_open(self):
        if self._closed:
            raise errors.ChannelClosed(f"channel {self.name!r} is closed")

    # ------------------------------------------------------------------------ array layout
    cdef uint64_t _region_offset(self, uint32_t index, bint reply):
        return (KT_HEADER_BYTES + <uint64_t>index * self._map.stride + KT_SLOT_HEADER_BYTES
                + (self.region_bytes if reply else 0))

    cdef list _lay_out(self, kt_meta* meta, list codes, list shapes, uint64_t region_off,
                       str what):
        """Write array metadata into `meta` and return writable views on the region."""
        cdef uint32_t n = len(codes)
        if n > KT_MAX_ARRAYS:
            raise ValueError(f"{what}: at most {KT_MAX_ARRAYS} arrays, got {n}")
        cdef uint64_t off = 0, count, nbytes
        cdef uint32_t i, d, ndim
        views = []
        for i in range(n):
            shape = shapes[i]
            ndim = len(shape)
            if ndim > KT_MAX_DIMS:
                raise ValueError(f"{what}: array {i} has {ndim} dims, at most {KT_MAX_DIMS}")
            dt = DTYPES[codes[i]][1]
            count = 1
            for d in range(ndim):
                count *= <uint64_t>shape[d]
            nbytes = count * dt.itemsize
            off = _align(off, KT_ARRAY_ALIGN)
            if off + nbytes > self.region_bytes:
                raise errors.PayloadTooLarge(
                    f"{what}: arrays need at least {off + nbytes} bytes, a slot region holds "
                    f"{self.region_bytes} (ChannelConfig.region_bytes)")
            meta.arrays[i].dtype = codes[i]
            meta.arrays[i].ndim = ndim
            for d in range(KT_MAX_DIMS):
                meta.arrays[i].shape[d] = shape[d] if d < ndim else 0
            meta.arrays[i].offset = off
            meta.arrays[i].nbytes = nbytes
            views.append(np.ndarray(shape, dt, self._mm, region_off + off))
            off += nbytes
        meta.num_arrays = n
        meta.message_len = 0
        return views

    cdef tuple _views(self, kt_meta* meta, uint64_t region_off, str what):
        """Validate metadata read from the segment and return (arrays, dtype names)."""
        cdef uint32_t n = meta.num_arrays
        if n > KT_MAX_ARRAYS:
            raise errors.MalformedMessage(f"{what}: num_arrays {n} > {KT_MAX_ARRAYS}")
        arrays, names = [], []
        for i in range(n):
            code = meta.arrays[i].dtype
            ndim = meta.arrays[i].ndim
            if code not in DTYPES:
                raise errors.MalformedMessage(f"{what}: array {i} has unknown dtype code {code}")
            if ndim > KT_MAX_DIMS:
                raise errors.MalformedMessage(f"{what}: array {i} has ndim {ndim}")
            name, dt = DTYPES[code]
            shape = tuple(meta.arrays[i].shape[d] for d in range(ndim))
            count = 1
            for s in shape:
                count *= s
            off, nbytes = meta.arrays[i].offset, meta.arrays[i].nbytes
            if nbytes != count * dt.itemsize or off % KT_ARRAY_ALIGN or off + nbytes > self.region_bytes:
                raise errors.MalformedMessage(
                    f"{what}: array {i} (shape {shape}, {name}) claims {nbytes} bytes at "
                    f"offset {off}, region is {self.region_bytes} bytes")
            arrays.append(np.ndarray(shape, dt, self._mm, region_off + off))
            names.append(name)
        return arrays, names

    cdef str _message_text(self, kt_meta* meta, uint64_t region_off):
        n = min(meta.message_len, self.region_bytes)
        return bytes(self._mm[region_off:region_off + n]).decode("utf-8", "replace")

    # ----------------------------------------------------------------------------- producer
    def begin(self, uint32_t kind, uint32_t layer, specs, uint32_t num_tokens=0):
        """Reserve the next slot and lay out arrays [(shape, dtype name)]; returns a Message
        whose arrays are writable views. Publish it with commit()."""
        self._check_open()
        if not self.is_producer:
            raise errors.KtshmError("begin() is the producer's; this end is a consumer")
        if self.device:
            raise errors.KtshmError("a device channel's slots are rung by bells: device_layout()")
        cdef uint64_t seq = self._next_seq
        cdef uint32_t index = seq % self.num_slots
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        cdef uint64_t w = kt_load_acquire(&slot.word)
        cdef uint32_t state = kt_word_state(w)
        if state != KT_SLOT_FREE:
            if state == KT_SLOT_REPLY and slot.seq in self._abandoned:
                self._abandoned.discard(slot.seq)
                self._inflight.pop(slot.seq, None)
            elif slot.seq not in self._inflight and slot.seq not in self._abandoned:
                raise errors.ChannelCorrupt(
                    f"slot {index} is in state {state} for a request this producer never sent "
                    f"or already released (its memory was overwritten)")
            else:
                raise errors.ChannelFull(
                    f"slot {index} still holds request {slot.seq}; receive or release it first "
                    f"({self.num_slots} slots)")
        codes = [_dtype_code(dt) for _, dt in specs]
        cdef uint64_t region_off = self._region_offset(index, False)
        arrays = self._lay_out(&slot.request, codes, [s for s, _ in specs], region_off, "request")
        cdef uint32_t last = slot.request.num_arrays - 1 if slot.request.num_arrays else 0
        cdef uint64_t end = (slot.request.arrays[last].offset + slot.request.arrays[last].nbytes
                             if slot.request.num_arrays else 0)
        payload = np.ndarray((end,), np.uint8, self._mm, region_off)
        slot.request.kind = kind
        slot.request.layer = layer
        slot.request.num_tokens = num_tokens
        slot.request.status = KT_OK
        self._next_seq += 1
        return Message(seq, index, kind, layer, num_tokens, KT_OK, arrays,
                       [DTYPES[c][0] for c in codes], payload)

    def commit(self, msg):
        """Publish a request prepared by begin(); returns its sequence number."""
        cdef uint64_t seq = msg.seq
        cdef uint32_t index = msg.slot
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        if not self._inflight:
            # NOTE: with nothing in flight there is nothing to resend: adopt the newest consumer.
            self._known_epoch = kt_current_epoch(self._base)
        slot.seq = seq
        slot.epoch = self._known_epoch
        slot.request_ns = kt_now_ns()
        self._inflight[seq] = self._known_epoch
        kt_store_release(&slot.word, kt_word(seq, self._known_epoch, KT_SLOT_REQUEST))
        kt_notify(&self._hdr.consumer_sleeping, self._sem_req)
        return seq

    def send(self, uint32_t kind, uint32_t layer, arrays, dtypes=None, uint32_t num_tokens=0):
        """Copy arrays into the next slot and publish them; returns the sequence number.

        dtypes optionally names each array's wire dtype (e.g. "bfloat16" for uint16 bits)."""
        msg = self.begin(kind, layer, _specs_of(arrays, dtypes), num_tokens)
        for dst, src in zip(msg.arrays, arrays):
            dst[...] = src
        return self.commit(msg)

    def recv(self, uint64_t seq, timeout=None):
        """Wait for the reply to `seq`; returns a Message viewing the reply region.

        The slot stays reserved until release(seq): copy what must outlive it. An error reply
        raises RemoteError (and releases the slot)."""
        self._check_open()
        if not self.is_producer:
            raise errors.KtshmError("recv() is the producer's; the consumer uses recv_request()")
        if self.device:
            raise errors.KtshmError("a device channel's replies are awaited with await_reply()")
        if seq not in self._inflight:
            raise errors.KtshmError(f"request {seq} is not in flight on {self.name!r}")
        cdef uint32_t index = seq % self.num_slots
        cdef kt_wait_args a
        a.map = &self._map
        a.is_producer = 1
        a.device = 0
        a.bell = NULL
        a.slot_index = index
        a.expect_word = kt_word(seq, self._inflight[seq], KT_SLOT_REPLY)
        a.known_epoch = self._known_epoch
        a.spin_ns = self._spin_ns
        a.deadline_ns = self._deadline(timeout)
        a.peer_timeout_ns = self._peer_timeout_ns
        a.sem = self._sem_rep
        cdef int st
        with nogil:
            st = kt_wait(&a)
        if st != KT_OK:
            self._raise_wait(st, f"waiting for the reply to request {seq} on {self.name!r}")
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        roff = self._region_offset(index, True)
        if slot.reply.status != KT_OK:
            status, text = slot.reply.status, self._message_text(&slot.reply, roff)
            self.release(seq)
            raise errors.RemoteError(status, text)
        try:
            arrays, names = self._views(&slot.reply, roff, f"reply to request {seq}")
        except errors.MalformedMessage:
            self.release(seq)
            raise
        return Message(seq, index, slot.reply.kind, slot.reply.layer, slot.reply.num_tokens,
                       KT_OK, arrays, names)

    def release(self, uint64_t seq):
        """Free the slot of a received request for reuse."""
        self._check_open()
        self._inflight.pop(seq, None)
        cdef uint32_t index = seq % self.num_slots
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        if slot.seq == seq:
            kt_store_release(&slot.word, kt_word(seq, 0, KT_SLOT_FREE))

    def call(self, uint32_t kind, uint32_t layer, arrays, dtypes=None, uint32_t num_tokens=0,
             timeout=None):
        """send + recv + copy out + release: the simple, copying round trip."""
        seq = self.send(kind, layer, arrays, dtypes, num_tokens)
        reply = self.recv(seq, timeout)
        try:
            return [a.copy() for a in reply.arrays]
        finally:
            self.release(seq)

    def abandon(self, uint64_t seq):
        """Give up on a request: its slot is reused once the consumer is done with it."""
        self._check_open()
        if seq not in self._inflight:
            return
        cdef uint32_t index = seq % self.num_slots
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        cdef uint64_t stamp = self._inflight[seq]
        if kt_cas(&slot.word, kt_word(seq, stamp, KT_SLOT_REQUEST), kt_word(seq, 0, KT_SLOT_FREE)):
            self._inflight.pop(seq)
            return
        if kt_word_state(kt_load_acquire(&slot.word)) == KT_SLOT_REPLY:
            self.release(seq)
            return
        self._abandoned.add(seq)

    def inflight(self):
        """Sequence numbers sent and not yet released, oldest first."""
        return sorted(s for s in self._inflight if s not in self._abandoned)

    def resend_inflight(self):
        """After PeerRestarted: re-stamp every request the old consumer did not answer with the
        new epoch, so the new consumer runs them. Replies it did publish stay valid. Returns the
        resent sequence numbers."""
        self._check_open()
        cdef uint32_t epoch = kt_current_epoch(self._base)
        cdef kt_slot_header* slot
        cdef uint64_t w
        resent = []
        for seq in sorted(self._inflight):
            slot = kt_slot(&self._map, seq % self.num_slots)
            w = kt_load_acquire(&slot.word)
            if kt_word_state(w) == KT_SLOT_REPLY and kt_word_seq32(w) == (seq & 0xffffffff):
                continue
            if seq in self._abandoned:
                self._abandoned.discard(seq)
                del self._inflight[seq]
                kt_store_release(&slot.word, kt_word(seq, 0, KT_SLOT_FREE))
                continue
            slot.epoch = epoch
            slot.request_ns = kt_now_ns()
            self._inflight[seq] = epoch
            kt_store_release(&slot.word, kt_word(seq, epoch, KT_SLOT_REQUEST))
            resent.append(seq)
        self._known_epoch = epoch
        kt_notify(&self._hdr.consumer_sleeping, self._sem_req)
        return resent

    def wait_for_peer(self, timeout=None):
        """Producer: wait until a consumer with a fresh heartbeat is attached; returns its epoch.

        Polls every millisecond up to the deadline, then raises ChannelTimeout."""
        self._check_open()
        deadline = time.monotonic() + (self.config.peer_timeout_s * 20 if timeout is None else timeout)
        while True:
            if (self._hdr.consumer_pid != 0
                    and kt_heartbeat_age_ns(&self._hdr.consumer_heartbeat_ns) < self._peer_timeout_ns):
                return kt_current_epoch(self._base)
            if time.monotonic() >= deadline:
                raise errors.ChannelTimeout(f"no consumer attached to {self.name!r} in time")
            time.sleep(0.001)

    # ------------------------------------------------------------------------ device producer
    cdef _check_device_producer(self, uint32_t index):
        self._check_open()
        if not (self.device and self.is_producer):
            raise errors.KtshmError("the producer end of a device channel only")
        if index >= self.num_slots:
            raise IndexError(f"slot {index} of {self.num_slots}")

    def device_layout(self, uint32_t index, uint32_t kind, uint32_t layer, specs, rows=None):
        """Lay out slot `index`'s request: arrays [(shape, dtype name)] at their full shapes,
        announced with only their first `rows` rows (None: all). The device fills the full
        layout; returns each array's offset in the request region."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        codes = [_dtype_code(dt) for _, dt in specs]
        shapes = [tuple(s) for s, _ in specs]
        self._lay_out(&slot.request, codes, shapes, self._region_offset(index, False),
                      f"device request in slot {index}")
        cdef uint32_t i
        cdef uint64_t row_bytes
        offsets = []
        for i in range(len(codes)):
            offsets.append(slot.request.arrays[i].offset)
            if rows is None:
                continue
            if not 0 <= rows <= shapes[i][0]:
                raise ValueError(f"rows {rows} outside [0, {shapes[i][0]}] of array {i}")
            row_bytes = slot.request.arrays[i].nbytes // shapes[i][0] if shapes[i][0] else 0
            slot.request.arrays[i].shape[0] = rows
            slot.request.arrays[i].nbytes = row_bytes * rows
        slot.request.kind = kind
        slot.request.layer = layer
        slot.request.num_tokens = shapes[0][0] if rows is None else rows
        slot.request.status = KT_OK
        return offsets

    def device_slot(self, uint32_t index):
        """Host addresses of slot `index`: (request_bell, reply_bell, request region, reply
        region). The bells are 32-bit words (ktshm.h: enum kt_bell)."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        base = <size_t>self._base
        return (<size_t>&slot.request_bell, <size_t>&slot.reply_bell,
                base + self._region_offset(index, False), base + self._region_offset(index, True))

    @property
    def done_address(self):
        """Host address of the 32-bit word a device sets when its step has ended."""
        self._check_open()
        return <size_t>&self._hdr.device_done

    def begin_step(self):
        """Before the device's work is launched: clear the done word; adopt the current
        consumer (one that attached since the last step is the one to serve this one)."""
        self._check_device_producer(0)
        kt_bell_store(&self._hdr.device_done, 0)
        self._known_epoch = kt_current_epoch(self._base)

    def ring(self, uint32_t index):
        """Post slot `index` from the host (what the device does with a stream write)."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        if kt_bell_load(&slot.request_bell) != KT_BELL_IDLE or kt_bell_load(&slot.reply_bell):
            raise errors.ChannelFull(f"device slot {index} still holds a call")
        kt_bell_store(&slot.request_bell, KT_BELL_POSTED)
        kt_notify(&self._hdr.consumer_sleeping, self._sem_req)

    def await_reply(self, uint32_t index, timeout=None):
        """Host side of the device's wait: block until slot `index` is answered; returns a
        Message viewing the reply (RemoteError for an error reply). Raises PeerDied /
        PeerRestarted like recv(); resend_claimed() then hands the call to the next consumer.
        The slot stays answered until finish(index)."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        cdef kt_wait_args a
        a.map = &self._map
        a.is_producer = 1
        a.device = 0
        a.bell = &slot.reply_bell
        a.bell_value = 1
        a.known_epoch = self._known_epoch
        a.spin_ns = self._spin_ns
        a.deadline_ns = self._deadline(timeout)
        a.peer_timeout_ns = self._peer_timeout_ns
        a.sem = self._sem_rep
        cdef int st
        with nogil:
            st = kt_wait(&a)
        if st != KT_OK:
            self._raise_wait(st, f"waiting for the reply in device slot {index} of {self.name!r}")
        return self.device_reply(index)

    def device_reply(self, uint32_t index):
        """The reply in slot `index` as a Message (RemoteError for an error reply)."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        roff = self._region_offset(index, True)
        if slot.reply.status != KT_OK:
            raise errors.RemoteError(slot.reply.status, self._message_text(&slot.reply, roff))
        arrays, names = self._views(&slot.reply, roff, f"reply in device slot {index}")
        return Message(0, index, slot.reply.kind, slot.reply.layer, slot.reply.num_tokens,
                       KT_OK, arrays, names)

    def finish(self, uint32_t index):
        """Reset slot `index`'s bells after its reply was read (what the device does after its
        wait), ready for the next call."""
        self._check_device_producer(index)
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        kt_bell_store(&slot.reply_bell, 0)
        kt_bell_store(&slot.request_bell, KT_BELL_IDLE)

    def resend_claimed(self):
        """After PeerDied / PeerRestarted: post again every slot a consumer claimed and did not
        answer, so the next consumer runs it; adopt the current consumer. Returns the slots."""
        self._check_device_producer(0)
        cdef kt_slot_header* slot
        cdef uint32_t i
        resent = []
        for i in range(self.num_slots):
            slot = kt_slot(&self._map, i)
            if kt_bell_load(&slot.reply_bell) == 0 and kt_bell_cas(
                    &slot.request_bell, KT_BELL_CLAIMED, KT_BELL_POSTED):
                resent.append(i)
        self._known_epoch = kt_current_epoch(self._base)
        kt_notify(&self._hdr.consumer_sleeping, self._sem_req)
        return resent

    def reset_device(self):
        """Every bell idle and the done word clear (before the first step, and after a step
        the device abandoned)."""
        self._check_device_producer(0)
        cdef uint32_t i
        for i in range(self.num_slots):
            kt_bell_store(&kt_slot(&self._map, i).reply_bell, 0)
            kt_bell_store(&kt_slot(&self._map, i).request_bell, KT_BELL_IDLE)
            kt_slot(&self._map, i).reply.status = KT_OK
        kt_bell_store(&self._hdr.device_done, 0)

    def bells(self, uint32_t index):
        """(request_bell, reply_bell) of slot `index` now (for tests and diagnostics)."""
        self._check_open()
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        return kt_bell_load(&slot.request_bell), kt_bell_load(&slot.reply_bell)

    # ----------------------------------------------------------------------------- consumer
    def recv_request(self, timeout=None):
        """Consumer: wait for the oldest request of this epoch and take it (state BUSY).

        A request with garbage metadata is answered with an EBADMSG error reply and raises
        MalformedMessage; the channel stays usable."""
        self._check_open()
        if self.is_producer:
            raise errors.KtshmError("recv_request() is the consumer's")
        cdef kt_wait_args a
        a.map = &self._map
        a.is_producer = 0
        a.device = self.device
        a.bell = NULL
        a.known_epoch = self._known_epoch
        a.spin_ns = self._spin_ns
        a.deadline_ns = self._deadline(timeout)
        a.peer_timeout_ns = self._peer_timeout_ns
        a.sem = self._sem_req
        cdef int st
        cdef kt_slot_header* slot
        cdef uint64_t busy
        if self._took or self._ready_ns == 0:
            self._ready_ns = kt_now_ns()  # NOTE: only the first look after a call: not a retry
            self._took = False
        while True:
            with nogil:
                st = kt_wait(&a)
            if st != KT_OK:
                self._raise_wait(st, f"waiting for a request on {self.name!r}")
            slot = kt_slot(&self._map, a.found_index)
            if self.device:
                if kt_bell_cas(&slot.request_bell, KT_BELL_POSTED, KT_BELL_CLAIMED):
                    break
                continue
            busy = kt_word(kt_word_seq32(a.found_word), kt_word_epoch(a.found_word), KT_SLOT_BUSY)
            if kt_cas(&slot.word, a.found_word, busy):
                break  # else: the producer abandoned or re-stamped it meanwhile
        self._awake_ns = kt_now_ns()
        self._request_ns = 0 if self.device else slot.request_ns
        self._took = True
        if self.device:
            self._device_calls += 1
            seq = self._device_calls
        else:
            seq = slot.seq
        index = a.found_index
        if not self._request_layouts:
            self._request_layouts = [None] * self.num_slots
            self._reply_layouts = [None] * self.num_slots
        meta = (<char*>&slot.request)[:sizeof(kt_meta)]
        layout = self._request_layouts[index]
        if layout is not None and layout[0] == meta:
            arrays, names = list(layout[1]), layout[2]  # NOTE: a list the caller may change
        else:
            try:
                arrays, names = self._views(&slot.request, self._region_offset(index, False),
                                            f"request {seq}")
            except errors.MalformedMessage as exc:
                self._request_layouts[index] = None
                self._publish_error(index, seq, errors.EBADMSG, str(exc))
                raise
            self._request_layouts[index] = (meta, list(arrays), names)
        msg = Message(seq, index, slot.request.kind, slot.request.layer,
                      slot.request.num_tokens, KT_OK, arrays, names)
        return msg

    def call_stamps(self):
        """Consumer: CLOCK_MONOTONIC nanoseconds (time.monotonic_ns's clock, shared by every
        process of the host) of its last call: (request published by the producer, 0 when not
        stamped (a device channel); this end ready for it, i.e. its first recv_request after
        the previous call; request found; reply published (its word stored, before a sleeping producer is woken))."""
        return self._request_ns, self._ready_ns, self._awake_ns, self._published_ns

    def begin_reply(self, request, specs):
        """Lay out reply arrays [(shape, dtype name)] for `request`; returns writable views."""
        self._check_open()
        cdef uint32_t index = request.slot
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        cdef bytes meta
        layout = self._reply_layouts[index] if self._reply_layouts else None
        if layout is not None and layout[0] == specs:
            meta = layout[1]
            memcpy(&slot.reply, <const char*>meta, sizeof(kt_meta))
            return layout[2]
        views = self._lay_out(&slot.reply, [_dtype_code(dt) for _, dt in specs],
                              [s for s, _ in specs], self._region_offset(index, True),
                              f"reply to request {request.seq}")
        if self._reply_layouts:
            self._reply_layouts[index] = (list(specs), (<char*>&slot.reply)[:sizeof(kt_meta)],
                                          views)
        return views

    def commit_reply(self, request, int32_t status=KT_OK):
        """Publish the reply laid out by begin_reply. Returns False when the request was
        resent or abandoned meanwhile (the reply is discarded)."""
        cdef uint32_t index = request.slot
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        slot.reply.kind = request.kind
        slot.reply.layer = request.layer
        slot.reply.num_tokens = request.num_tokens
        slot.reply.status = status
        return self._publish(index, request.seq)

    def reply(self, request, arrays=(), dtypes=None):
        """Copy arrays into the reply region of `request` and publish it."""
        views = self.begin_reply(request, _specs_of(arrays, dtypes))
        for dst, src in zip(views, arrays):
            dst[...] = src
        return self.commit_reply(request)

    def reply_error(self, request, int32_t status, str message):
        """Answer `request` with an error status and a message (raised as RemoteError there)."""
        self._check_open()
        if status == KT_OK:
            raise ValueError("reply_error needs a non-zero status")
        return self._publish_error(request.slot, request.seq, status, message)

    cdef bint _publish_error(self, uint32_t index, uint64_t seq, int32_t status, str message):
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        data = message.encode("utf-8")[: self.region_bytes]
        off = self._region_offset(index, True)
        self._mm[off:off + len(data)] = data
        slot.reply.num_arrays = 0
        slot.reply.message_len = len(data)
        slot.reply.status = status
        slot.reply.kind = 0
        slot.reply.layer = 0
        slot.reply.num_tokens = 0
        return self._publish(index, seq)

    cdef bint _publish(self, uint32_t index, uint64_t seq):
        cdef kt_slot_header* slot = kt_slot(&self._map, index)
        if self.device:
            if kt_current_epoch(self._base) != self._known_epoch:
                return False  # superseded: the call was handed to the next consumer
            kt_bell_store(&slot.reply_bell, 1)
            self._published_ns = kt_now_ns()
            kt_notify(&self._hdr.producer_sleeping, self._sem_rep)
            return True
        cdef uint64_t busy = kt_word(seq, self._known_epoch, KT_SLOT_BUSY)
        ok = kt_cas(&slot.word, busy, kt_word(seq, self._known_epoch, KT_SLOT_REPLY))
        self._published_ns = kt_now_ns()  # NOTE: before the notify: a spinning peer has it now
        kt_notify(&self._hdr.producer_sleeping, self._sem_rep)
        return bool(ok)

    # ------------------------------------------------------------------------------ helpers
    cdef uint64_t _deadline(self, timeout):
        t = self.config.default_timeout_s if timeout is None else timeout
        if t < 0:
            raise ValueError(f"timeout must be >= 0, got {t}")
        return kt_now_ns() + <uint64_t>(min(t, 1e7) * 1e9)

    cdef _raise_wait(self, int st, str context):
        cdef int err = errno
        exc = errors.error_for_status(st, context, err)
        if st == KT_EPEER_RESTARTED and self.is_producer:
            exc.inflight = self.inflight()
        raise exc


def wait_device_step(channels, timeout, fail_status=0, until_called=False):
    """Host side of one device step over device channels (producer ends): wait until the
    device sets channels[0]'s done word, waking consumers that sleep on a posted bell and
    checking their heartbeats (see kt_wait_step in ktshm.h). Returns None when every call was
    answered, else (status, channel index, slot): KT status codes EREMOTE (that slot's reply is
    an error: device_reply() raises it), EPEER_DIED, EPEER_RESTARTED or ETIMEOUT. A non-zero
    fail_status answers every posted bell with that error instead (the consumers are gone and
    the device must get through the step). until_called: return None already once every
    channel has a call of the step, its consumer woken (the host has other work before it
    waits for the rest of the step)."""
    cdef Channel ch
    cdef uint32_t n = len(channels)
    if until_called and fail_status:
        raise ValueError("until_called wakes consumers; fail_status answers for them: not both")
    if n == 0:
        raise ValueError("no channels")
    if n > 64:
        raise ValueError(f"at most 64 channels, got {n}")
    cdef const kt_map* maps[64]
    cdef sem_t* sems[64]
    cdef uint32_t epochs[64]
    cdef uint32_t i
    for i in range(n):
        ch = channels[i]
        ch._check_device_producer(0)
        maps[i] = &ch._map
        sems[i] = ch._sem_req
        epochs[i] = ch._known_epoch
    ch = channels[0]
    cdef kt_step_args a
    a.maps = maps
    a.sems = sems
    a.epochs = epochs
    a.n = n
    a.deadline_ns = ch._deadline(timeout)
    a.peer_timeout_ns = ch._peer_timeout_ns
    a.fail = fail_status != 0
    a.fail_status = fail_status
    a.found_channel = 0
    a.found_slot = 0
    a.until_called = 1 if until_called else 0
    a.called = 0
    cdef int st
    with nogil:
        st = kt_wait_step(&a)
    if st == KT_OK:
        return None
    return st, a.found_channel, a.found_slot


def cleanup_stale(max_age_s=10.0):
    """Unlink channels whose creator's heartbeat is older than max_age_s (a killed producer),
    and orphaned semaphores of channels that no longer exist. Returns the names removed."""
    removed = []
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return removed
    now_wall = time.time()
    for entry in entries:
        if entry.startswith(SEGMENT_PREFIX):
            if _segment_is_stale(entry, max_age_s):
                _unlink_all(entry)
                removed.append(entry)
        elif entry.startswith("sem." + SEGMENT_PREFIX):
            name = entry[len("sem."):].rsplit(".", 1)[0]
            if os.path.exists(f"/dev/shm/{name}"):
                continue
            try:
                if now_wall - os.stat(f"/dev/shm/{entry}").st_mtime < max_age_s:
                    continue
                posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
                removed.append(entry)
            except (OSError, posix_ipc.ExistentialError):
                pass
    return removed


def _segment_is_stale(str name, double max_age_s):
    path = f"/dev/shm/{name}"
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid():
            return False
        with open(path, "rb") as f:
            head = f.read(KT_HEADER_BYTES)
    except OSError:
        return False
    if len(head) < KT_HEADER_BYTES or int.from_bytes(head[0:8], "little") != KT_MAGIC:
        # not (yet) initialised: only an old one is garbage
        return time.time() - st.st_mtime > max_age_s
    hb = int.from_bytes(head[64:72], "little")
    if hb == 0:
        return True
    return (kt_now_ns() - hb) / 1e9 > max_age_s if kt_now_ns() > hb else False
