"""ktshm channel: round trips, stress, bad input, peer death and restart, hygiene."""

from __future__ import annotations

import mmap
import os
import secrets
import stat
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest
from ktshm.channel import NAME_TAG_ENV, SEGMENT_PREFIX, name_prefix, new_channel_name

import ktshm
from tests.support.consumer_proc import KIND_BUSY, KIND_ECHO, KIND_EXIT, KIND_HANG, checksum
from tests.support.expert_procs import RUN_PREFIX, no_new_segments, shm_entries

FAST = ktshm.ChannelConfig(num_slots=8, region_bytes=1 << 16, spin_us=50, peer_timeout_s=0.3)


@pytest.fixture
def producer():
    ch = ktshm.Channel.create(FAST)
    yield ch
    ch.close()


def random_arrays(rng: np.random.Generator, num_tokens: int, hidden: int = 96, k: int = 4):
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    ids = rng.integers(-1, 16, size=(num_tokens, k), dtype=np.int32)
    w = rng.random((num_tokens, k), dtype=np.float32)
    return [x, ids, w]


def raw_segment(name: str) -> mmap.mmap:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------- round trips
def test_round_trip_in_one_process(producer, rng):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        for num_tokens in (1, 3, 17, 64):
            arrays = random_arrays(rng, num_tokens)
            bf16_bits = rng.integers(0, 1 << 16, size=(num_tokens, 8), dtype=np.uint16)
            seq = producer.send(
                7,
                3,
                [*arrays, bf16_bits],
                dtypes=[None, None, None, "bfloat16"],
                num_tokens=num_tokens,
            )
            req = consumer.recv_request(timeout=5)
            assert (req.seq, req.kind, req.layer, req.num_tokens) == (seq, 7, 3, num_tokens)
            assert req.dtypes == ["float32", "int32", "float32", "bfloat16"]
            for got, sent in zip(req.arrays, [*arrays, bf16_bits]):
                np.testing.assert_array_equal(got, sent)
            y = consumer.begin_reply(req, [((num_tokens, 96), "float32")])[0]
            y[...] = req.arrays[0] * 2
            assert consumer.commit_reply(req)
            reply = producer.recv(seq, timeout=5)
            np.testing.assert_array_equal(reply.arrays[0], arrays[0] * 2)
            assert reply.layer == 3 and reply.num_tokens == num_tokens
            producer.release(seq)
    finally:
        consumer.close()


def test_a_slot_reused_with_other_layouts_carries_each_call_as_sent(rng):
    """One slot, calls whose layouts repeat and change (the consumer reuses a repeated
    layout's views): every request and reply arrives as it was written."""
    config = ktshm.ChannelConfig(num_slots=1, region_bytes=1 << 16, spin_us=50)
    with ktshm.Channel.create(config) as producer:
        consumer = ktshm.Channel.attach(producer.name, config)
        try:
            calls = [(1, "float32"), (1, "float32"), (3, "float32"), (1, "bfloat16"),
                     (1, "float32"), (2, "float32")]  # fmt: skip
            for num_tokens, out_dtype in calls:
                arrays = random_arrays(rng, num_tokens)
                seq = producer.send(5, num_tokens, arrays, num_tokens=num_tokens)
                req = consumer.recv_request(timeout=5)
                assert req.layer == num_tokens and req.dtypes == ["float32", "int32", "float32"]
                for got, sent in zip(req.arrays, arrays):
                    np.testing.assert_array_equal(got, sent)
                want = rng.integers(0, 1 << 15, size=(num_tokens, 96)).astype(np.float32)
                (y,) = consumer.begin_reply(req, [((num_tokens, 96), out_dtype)])
                y[...] = want if out_dtype == "float32" else want.astype(np.uint16)
                assert consumer.commit_reply(req)
                reply = producer.recv(seq, timeout=5)
                assert reply.dtypes == [out_dtype] and reply.arrays[0].shape == (num_tokens, 96)
                np.testing.assert_array_equal(reply.arrays[0].astype(np.float32), want)
                producer.release(seq)
        finally:
            consumer.close()


def test_garbage_metadata_after_a_good_call_in_the_same_slot_is_refused(rng):
    config = ktshm.ChannelConfig(num_slots=1, region_bytes=1 << 16, spin_us=50)
    with ktshm.Channel.create(config) as producer:
        consumer = ktshm.Channel.attach(producer.name, config)
        raw = raw_segment(producer.name)
        try:
            for corrupt in (False, True):
                msg = producer.begin(0, 0, [((4,), "float32")])
                msg.arrays[0][...] = np.arange(4)
                if corrupt:  # request meta at 4096 + 80; array 0's nbytes at +24+32
                    raw[4096 + 80 + 56] = 255
                seq = producer.commit(msg)
                if corrupt:
                    with pytest.raises(ktshm.MalformedMessage, match="claims"):
                        consumer.recv_request(timeout=5)
                    with pytest.raises(ktshm.RemoteError, match="claims"):
                        producer.recv(seq, timeout=5)
                    continue
                req = consumer.recv_request(timeout=5)
                np.testing.assert_array_equal(req.arrays[0], np.arange(4))
                consumer.reply(req, req.arrays)
                producer.recv(seq, 5)
                producer.release(seq)
        finally:
            raw.close()
            consumer.close()


def test_payload_views_are_zero_copy(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        msg = producer.begin(0, 0, [((4, 8), "float32")])
        msg.arrays[0][...] = 1.5
        seq = producer.commit(msg)
        req = consumer.recv_request(timeout=5)
        # both ends' arrays are views on their mapping of the segment, not copies
        assert isinstance(req.arrays[0].base, mmap.mmap)
        assert isinstance(msg.arrays[0].base, mmap.mmap)
        np.testing.assert_array_equal(req.arrays[0], np.full((4, 8), 1.5, np.float32))
        assert not req.arrays[0].flags.owndata
        assert req.arrays[0].ctypes.data % 64 == 0
        consumer.reply(req, [req.arrays[0]])
        producer.recv(seq, timeout=5)
        producer.release(seq)
    finally:
        consumer.close()


def test_one_bulk_write_through_the_payload_fills_every_array(producer, rng):
    """begin()'s payload spans the arrays at their offsets: bytes packed the same way elsewhere
    (as the GPU service lays them out on the device) arrive as the arrays."""
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        arrays = [
            rng.standard_normal((3, 5)).astype(np.float32),
            rng.integers(-1, 9, (3, 2)).astype(np.int32),
            np.arange(7, dtype=np.uint16),
        ]
        msg = producer.begin(0, 2, [(a.shape, a.dtype.name) for a in arrays], 3)
        base = msg.payload.ctypes.data
        packed = np.zeros(msg.payload.nbytes, np.uint8)
        for view, a in zip(msg.arrays, arrays):
            offset = view.ctypes.data - base
            assert offset % 64 == 0
            packed[offset : offset + a.nbytes] = a.view(np.uint8).ravel()
        assert msg.payload.nbytes == (msg.arrays[-1].ctypes.data - base) + arrays[-1].nbytes
        msg.payload[...] = packed
        seq = producer.commit(msg)
        req = consumer.recv_request(timeout=5)
        assert req.payload is None
        for got, sent in zip(req.arrays, arrays):
            np.testing.assert_array_equal(got, sent)
        consumer.reply(req, [])
        producer.recv(seq, timeout=5)
        producer.release(seq)
    finally:
        consumer.close()


def test_round_trips_across_processes(producer, spawn_consumer, rng):
    spawn_consumer(producer.name)
    for num_tokens in (1, 5, 33, 100):
        arrays = random_arrays(rng, num_tokens)
        out = producer.call(KIND_ECHO, 1, arrays, timeout=10)
        for got, sent in zip(out, arrays):
            np.testing.assert_array_equal(got, sent)
        assert out[-1][0] == checksum(arrays)[0]


def test_stress_100k_messages_with_several_in_flight(spawn_consumer, rng):
    config = ktshm.ChannelConfig(num_slots=8, region_bytes=1 << 14, spin_us=50)
    total, window = 100_000, 6
    with ktshm.Channel.create(config) as producer:
        spawn_consumer(producer.name)
        pool = [random_arrays(rng, int(rng.integers(1, 8)), hidden=64) for _ in range(64)]
        sums = [int(checksum(a)[0]) for a in pool]
        pending: list[tuple[int, int]] = []
        sent = received = 0
        while received < total:
            while sent < total and len(pending) < window:
                which = sent % len(pool)
                pending.append((producer.send(KIND_ECHO, sent % 61, pool[which]), which))
                sent += 1
            seq, which = pending.pop(0)
            reply = producer.recv(seq, timeout=10)
            assert reply.layer == seq % 61
            assert int(reply.arrays[-1][0]) == sums[which], f"checksum mismatch at seq {seq}"
            np.testing.assert_array_equal(reply.arrays[0], pool[which][0])
            producer.release(seq)
            received += 1
        assert producer.inflight() == []


def test_replies_can_be_received_out_of_order(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        seqs = [producer.send(0, i, [np.full(3, i, np.int32)]) for i in range(5)]
        for _ in seqs:
            req = consumer.recv_request(timeout=5)
            consumer.reply(req, [req.arrays[0] + 100])
        for seq in reversed(seqs):
            reply = producer.recv(seq, timeout=5)
            np.testing.assert_array_equal(reply.arrays[0], np.full(3, seq + 100, np.int32))
            producer.release(seq)
    finally:
        consumer.close()


def test_channel_full_when_every_slot_is_in_flight(producer):
    for _ in range(producer.num_slots):
        producer.send(0, 0, [np.zeros(4, np.float32)])
    with pytest.raises(ktshm.ChannelFull, match="receive or release"):
        producer.send(0, 0, [np.zeros(4, np.float32)])


# ------------------------------------------------------------------------- bad input
def test_attach_to_missing_name():
    with pytest.raises(ktshm.ChannelNotFound, match="no ktshm channel"):
        ktshm.Channel.attach(new_channel_name())


def test_attach_to_wrong_magic():
    name = new_channel_name()
    shm = posix_ipc.SharedMemory(f"/{name}", posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    shm.close_fd()
    try:
        with pytest.raises(ktshm.LayoutMismatch, match="not a ktshm channel"):
            ktshm.Channel.attach(name)
    finally:
        posix_ipc.unlink_shared_memory(f"/{name}")


def test_attach_to_wrong_layout_version(producer):
    raw = raw_segment(producer.name)
    try:
        raw[8:12] = (999).to_bytes(4, "little")
        with pytest.raises(ktshm.LayoutMismatch, match="layout version 999"):
            ktshm.Channel.attach(producer.name)
    finally:
        raw.close()


def test_attach_to_inconsistent_header(producer):
    raw = raw_segment(producer.name)
    try:
        raw[12:16] = (producer.num_slots + 5).to_bytes(4, "little")
        with pytest.raises(ktshm.LayoutMismatch, match="inconsistent"):
            ktshm.Channel.attach(producer.name)
    finally:
        raw.close()


def test_payload_larger_than_a_slot(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        too_big = np.zeros(producer.region_bytes // 4 + 1, np.float32)
        with pytest.raises(ktshm.PayloadTooLarge, match="slot region holds"):
            producer.send(0, 0, [too_big])
        # nothing was published and the channel keeps working
        assert producer.inflight() == []
        seq = producer.send(0, 0, [np.ones(4, np.float32)])
        req = consumer.recv_request(timeout=5)
        assert req.seq == seq
    finally:
        consumer.close()


def test_unsupported_dtype_and_too_many_arrays(producer):
    with pytest.raises(ValueError, match="unsupported dtype"):
        producer.send(0, 0, [np.zeros(3, np.complex64)])
    with pytest.raises(ValueError, match="at most 4 arrays"):
        producer.send(0, 0, [np.zeros(1, np.float32)] * 5)
    with pytest.raises(ValueError, match="has 5 dims, at most 4"):
        producer.send(0, 0, [np.zeros((1, 1, 1, 1, 1), np.float32)])


def test_garbage_metadata_gets_an_error_reply(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    raw = raw_segment(producer.name)
    try:
        msg = producer.begin(0, 0, [((4,), "float32")])
        # slot header at 4096 + index*stride; request meta starts at +64+16; array 0 dtype at +24
        stride = int.from_bytes(raw[24:32], "little")
        meta = 4096 + msg.slot * stride + 80
        raw[meta + 24] = 99
        seq = producer.commit(msg)
        with pytest.raises(ktshm.MalformedMessage, match="unknown dtype code 99"):
            consumer.recv_request(timeout=5)
        with pytest.raises(ktshm.RemoteError, match="unknown dtype code 99") as info:
            producer.recv(seq, timeout=5)
        assert info.value.status == 4
        # the channel still serves the next message
        seq = producer.send(0, 0, [np.arange(4, dtype=np.float32)])
        req = consumer.recv_request(timeout=5)
        consumer.reply(req, req.arrays)
        np.testing.assert_array_equal(producer.recv(seq, 5).arrays[0], np.arange(4))
        producer.release(seq)
    finally:
        raw.close()
        consumer.close()


def test_garbage_reply_metadata_is_rejected(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    raw = raw_segment(producer.name)
    try:
        seq = producer.send(0, 0, [np.zeros(4, np.float32)])
        req = consumer.recv_request(timeout=5)
        views = consumer.begin_reply(req, [((4,), "float32")])
        views[0][...] = 1
        stride = int.from_bytes(raw[24:32], "little")
        reply_meta = 4096 + req.slot * stride + 80 + 184
        raw[reply_meta + 24 + 32 : reply_meta + 24 + 40] = (10**12).to_bytes(8, "little")
        consumer.commit_reply(req)
        with pytest.raises(ktshm.MalformedMessage, match="claims"):
            producer.recv(seq, timeout=5)
        assert producer.inflight() == []
    finally:
        raw.close()
        consumer.close()


def test_wait_past_its_deadline(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        seq = producer.send(0, 0, [np.zeros(4, np.float32)])
        start = time.monotonic()
        with pytest.raises(ktshm.ChannelTimeout, match=f"reply to request {seq}"):
            producer.recv(seq, timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 2
        consumer.recv_request(timeout=5)
        with pytest.raises(TimeoutError):  # ChannelTimeout is a TimeoutError
            consumer.recv_request(timeout=0.05)
    finally:
        consumer.close()


def test_error_reply_from_the_consumer(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    try:
        seq = producer.send(0, 0, [np.zeros(4, np.float32)])
        req = consumer.recv_request(timeout=5)
        consumer.reply_error(req, 42, "layer 9 is not loaded")
        with pytest.raises(ktshm.RemoteError, match="layer 9 is not loaded") as info:
            producer.recv(seq, timeout=5)
        assert info.value.status == 42
        assert producer.inflight() == []
    finally:
        consumer.close()


def test_closed_channel_and_role_errors(producer):
    consumer = ktshm.Channel.attach(producer.name, FAST)
    with pytest.raises(ktshm.KtshmError, match="producer's"):
        consumer.send(0, 0, [np.zeros(1, np.float32)])
    with pytest.raises(ktshm.KtshmError, match="consumer's"):
        producer.recv_request(timeout=0.01)
    consumer.close()
    with pytest.raises(ktshm.ChannelClosed):
        consumer.recv_request(timeout=0.01)


# ------------------------------------------------------------------ peers: death and restart
def test_second_live_consumer_is_refused(producer):
    first = ktshm.Channel.attach(producer.name, FAST)
    try:
        with pytest.raises(ktshm.ChannelBusy, match="live consumer"):
            ktshm.Channel.attach(producer.name, FAST)
    finally:
        first.close()
    second = ktshm.Channel.attach(producer.name, FAST)  # the first detached: allowed
    assert second.epoch == first.epoch + 1
    second.close()


def test_no_consumer_means_peer_died(producer):
    seq = producer.send(0, 0, [np.zeros(4, np.float32)])
    with pytest.raises(ktshm.PeerDied):
        producer.recv(seq, timeout=5)


def test_kill_consumer_mid_message_then_restart(producer, spawn_consumer, rng):
    first = spawn_consumer(producer.name, "--hang")
    arrays = random_arrays(rng, 5)
    seq_ok = producer.send(KIND_ECHO, 0, arrays)
    reply = producer.recv(seq_ok, timeout=10)
    producer.release(seq_ok)
    seq_hang = producer.send(KIND_HANG, 1, arrays)
    assert first.read_line() == f"took {seq_hang}"
    seq_queued = producer.send(KIND_ECHO, 2, arrays)
    first.proc.kill()
    start = time.monotonic()
    with pytest.raises(ktshm.PeerDied):
        producer.recv(seq_hang, timeout=10)
    assert time.monotonic() - start < 1.0, "peer death must be detected within a second"
    first.kill()

    second = spawn_consumer(producer.name)
    epoch = producer.wait_for_peer(timeout=10)
    with pytest.raises(ktshm.PeerRestarted) as info:
        producer.recv(seq_hang, timeout=10)
    assert info.value.inflight == [seq_hang, seq_queued]
    assert producer.resend_inflight() == [seq_hang, seq_queued]
    assert producer.epoch == epoch
    for seq, layer in ((seq_hang, 1), (seq_queued, 2)):
        reply = producer.recv(seq, timeout=10)
        assert reply.layer == layer
        assert int(reply.arrays[-1][0]) == int(checksum(arrays)[0])
        producer.release(seq)
    # and new traffic flows
    out = producer.call(KIND_ECHO, 3, arrays, timeout=10)
    np.testing.assert_array_equal(out[0], arrays[0])
    second.proc.stdin.close()


def test_stale_reply_of_superseded_consumer_is_discarded(producer):
    old = ktshm.Channel.attach(producer.name, FAST)
    new = None
    try:
        seq = producer.send(0, 0, [np.full(4, 1, np.float32)])
        req_old = old.recv_request(timeout=5)
        new = ktshm.Channel.attach(producer.name, FAST, force=True)
        with pytest.raises(ktshm.PeerRestarted):
            producer.recv(seq, timeout=5)
        assert producer.resend_inflight() == [seq]
        req_new = new.recv_request(timeout=5)
        assert req_new.seq == seq
        # the superseded consumer answers late: its reply must not land
        assert old.reply(req_old, [np.full(4, -1, np.float32)]) is False
        assert new.reply(req_new, [np.full(4, 2, np.float32)]) is True
        np.testing.assert_array_equal(producer.recv(seq, 5).arrays[0], np.full(4, 2, np.float32))
        producer.release(seq)
        with pytest.raises(ktshm.PeerRestarted):  # the old consumer learns it was superseded
            old.recv_request(timeout=5)
    finally:
        old.close()
        if new is not None:
            new.close()


def test_reply_published_before_death_is_kept(producer, spawn_consumer, rng):
    consumer = spawn_consumer(producer.name)
    arrays = random_arrays(rng, 2)
    seq_done = producer.send(KIND_EXIT, 0, arrays)
    assert consumer.proc.wait(timeout=10) == 0
    reply = producer.recv(seq_done, timeout=5)  # replied, then exited: the reply is valid
    np.testing.assert_array_equal(reply.arrays[0], arrays[0])
    producer.release(seq_done)


def test_busy_consumer_holding_the_gil_is_not_declared_dead(producer, spawn_consumer):
    spawn_consumer(producer.name)
    busy_for = 3 * producer.config.peer_timeout_s
    out = producer.call(KIND_BUSY, 0, [np.array([busy_for], np.float64)], timeout=10)
    assert out[0][0] == busy_for


def test_consumer_sees_producer_death_within_a_second():
    code = (
        "import ktshm, sys\n"
        "ch = ktshm.Channel.create(ktshm.ChannelConfig(peer_timeout_s=0.3))\n"
        "print(ch.name, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    name = proc.stdout.readline().strip()
    consumer = ktshm.Channel.attach(name, FAST)
    try:
        proc.kill()
        proc.wait()
        start = time.monotonic()
        with pytest.raises(ktshm.PeerDied):
            consumer.recv_request(timeout=10)
        assert time.monotonic() - start < 1.0
    finally:
        consumer.close()
        proc.stdin.close()
        proc.stdout.close()
    # the killed creator could not unlink its segment: stale cleanup removes it
    assert os.path.exists(f"/dev/shm/{name}")
    deadline = time.monotonic() + 10
    while name not in ktshm.cleanup_stale(max_age_s=0.2):
        assert time.monotonic() < deadline, "stale segment was never cleaned"
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/sem.{name}.req")


# ------------------------------------------------------------------------- hygiene
def test_segment_and_semaphores_are_owner_only(producer):
    paths = [
        f"/dev/shm/{producer.name}",
        f"/dev/shm/sem.{producer.name}.req",
        f"/dev/shm/sem.{producer.name}.rep",
    ]
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert producer.name.startswith(SEGMENT_PREFIX)
    assert len(producer.name.rsplit(".", 1)[1]) == 16  # 64 random bits


def test_names_are_unique_per_channel():
    with ktshm.Channel.create(FAST) as a, ktshm.Channel.create(FAST) as b:
        assert a.name != b.name


def test_close_unlinks_and_later_attach_fails():
    ch = ktshm.Channel.create(FAST)
    name = ch.name
    ch.close()
    ch.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(ktshm.ChannelNotFound):
        ktshm.Channel.attach(name)


def test_dropped_producer_unlinks_its_names():
    ch = ktshm.Channel.create(FAST)
    name = ch.name
    del ch  # never closed: the last reference goes
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/sem.{name}.req")


def test_creator_exit_unlinks_at_exit():
    code = "import ktshm\nch = ktshm.Channel.create()\nprint(ch.name)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name = out.stdout.strip()
    assert name.startswith(SEGMENT_PREFIX)
    assert name.startswith(RUN_PREFIX)  # a child of the run inherits its tag
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/sem.{name}.req")


def test_config_is_validated():
    with pytest.raises(ValueError, match="num_slots"):
        ktshm.ChannelConfig(num_slots=0)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        ktshm.ChannelConfig(peer_timeout_s=0.01, heartbeat_period_s=0.02)


def test_name_tag_from_the_environment(monkeypatch):
    monkeypatch.delenv(NAME_TAG_ENV)
    assert name_prefix() == SEGMENT_PREFIX
    assert new_channel_name().startswith(f"{SEGMENT_PREFIX}{os.getpid()}.")
    monkeypatch.setenv(NAME_TAG_ENV, "run-7_x")
    assert new_channel_name().startswith(f"{SEGMENT_PREFIX}run-7_x.{os.getpid()}.")
    for bad in ("a/b", "a.b", "x" * 33):
        monkeypatch.setenv(NAME_TAG_ENV, bad)
        with pytest.raises(ValueError, match=NAME_TAG_ENV):
            new_channel_name()


def test_this_run_is_tagged(producer):
    """conftest tags the run's names, and the segment checks count exactly those."""
    assert NAME_TAG_ENV == "KTSHM_NAME_TAG"  # the name conftest sets
    assert RUN_PREFIX == f"{SEGMENT_PREFIX}{os.environ[NAME_TAG_ENV]}." == name_prefix()
    assert producer.name.startswith(RUN_PREFIX)
    own = {producer.name, f"sem.{producer.name}.req", f"sem.{producer.name}.rep"}
    assert own <= shm_entries()


def test_segment_check_fails_on_this_runs_leftovers_only():
    """A channel of this run left open, or left by a killed child, fails the check; one of another
    process (an untagged name, as any other ktserve process makes) does not."""
    leftover = pytest.raises(AssertionError, match="left shared-memory entries behind")
    with leftover, no_new_segments():
        left_open = ktshm.Channel.create(FAST)
    left_open.close()
    code = "import ktshm, sys\nch = ktshm.Channel.create()\nprint(ch.name, flush=True)\n"
    code += "sys.stdin.read()\n"
    with leftover, no_new_segments():
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            name = child.stdout.readline().strip()
        finally:
            child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()
    posix_ipc.unlink_shared_memory(f"/{name}")
    for sem in (f"/{name}.req", f"/{name}.rep"):
        posix_ipc.unlink_semaphore(sem)
    with no_new_segments():
        other = ktshm.Channel.create(FAST, name=f"{SEGMENT_PREFIX}1.{secrets.token_hex(8)}")
    other.close()
