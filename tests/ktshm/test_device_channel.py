"""ktshm device channels: slots rung by bells (as a GPU stream rings them), the host's step wait.

A thread here plays the device: it fills a slot's request region through its address, posts the
request bell, waits for the reply bell, reads the reply and resets the bells, exactly the
sequence the decode step's CUDA graph records with stream writes and waits.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

import ktshm
from ktshm import errors
from tests.support.consumer_proc import KIND_ECHO, KIND_HANG, checksum

FAST = ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16, spin_us=50, peer_timeout_s=0.3)
IDLE, POSTED, CLAIMED = 0, 1, 2


@pytest.fixture
def device():
    ch = ktshm.Channel.create(FAST, device=True)
    yield ch
    ch.close()


def u32(address: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(address)


def fill(channel: ktshm.Channel, slot: int, offsets: list[int], arrays: list[np.ndarray]) -> None:
    """Write arrays at their offsets in the slot's request region, as the device's copy does."""
    region = channel.device_slot(slot)[2]
    for offset, a in zip(offsets, arrays):
        ctypes.memmove(region + offset, a.ctypes.data, a.nbytes)


class DeviceThread(threading.Thread):
    """Plays the device's step: for each slot in order, post, wait for the reply (spinning on
    the bell like cuStreamWaitValue32), copy the checksum out, reset; then set the done word.
    first_call_after_s: the step's GPU work before its first call; go_on: set, the calls after
    the first go on."""

    def __init__(self, channel: ktshm.Channel, slots: list[int], first_call_after_s: float = 0.0,
                 go_on: threading.Event | None = None) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.channel, self.slots = channel, slots
        self.first_call_after_s, self.go_on = first_call_after_s, go_on
        self.replies: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        time.sleep(self.first_call_after_s)
        for slot in self.slots:
            if self.replies and self.go_on is not None:
                self.go_on.wait()
            req_bell, rep_bell, _, _ = self.channel.device_slot(slot)
            u32(req_bell).value = POSTED
            while u32(rep_bell).value != 1:
                if self.stop.is_set():
                    return
            reply = self.channel.device_reply(slot) if self._ok(slot) else None
            self.replies.append(int(reply.arrays[-1][0]) if reply is not None else -1)
            u32(rep_bell).value = 0
            u32(req_bell).value = IDLE
        u32(self.channel.done_address).value = 1

    def _ok(self, slot: int) -> bool:
        try:
            self.channel.device_reply(slot)
            return True
        except ktshm.RemoteError:
            return False


def test_round_trip_with_fewer_rows_announced_than_laid_out(device, rng):
    consumer = ktshm.Channel.attach(device.name, FAST)
    try:
        x = rng.standard_normal((8, 16)).astype(np.float32)
        ids = rng.integers(0, 8, size=(8, 2), dtype=np.int32)
        specs = [((8, 16), "float32"), ((8, 2), "int32")]
        offsets = device.device_layout(2, KIND_ECHO, 7, specs, rows=3)
        assert offsets[0] == 0 and offsets[1] % 64 == 0 and offsets[1] >= x.nbytes
        fill(device, 2, offsets, [x, ids])
        device.begin_step()
        device.ring(2)
        assert device.bells(2) == (POSTED, 0)
        req = consumer.recv_request(timeout=5)
        assert device.bells(2) == (CLAIMED, 0)
        assert (req.slot, req.kind, req.layer, req.num_tokens) == (2, KIND_ECHO, 7, 3)
        np.testing.assert_array_equal(req.arrays[0], x[:3])
        np.testing.assert_array_equal(req.arrays[1], ids[:3])
        assert consumer.reply(req, [req.arrays[0] * 2]) is True
        reply = device.await_reply(2, timeout=5)
        np.testing.assert_array_equal(reply.arrays[0], x[:3] * 2)
        with pytest.raises(ktshm.ChannelFull):  # answered, not yet finished
            device.ring(2)
        device.finish(2)
        assert device.bells(2) == (IDLE, 0)
        device.ring(2)  # the same layout serves the next step
        req = consumer.recv_request(timeout=5)
        consumer.reply_error(req, 9, "no such layer")
        with pytest.raises(ktshm.RemoteError, match="no such layer"):
            device.await_reply(2, timeout=5)
    finally:
        consumer.close()


def test_word_calls_are_refused_on_a_device_channel(device):
    with pytest.raises(ktshm.KtshmError, match="bells"):
        device.begin(0, 0, [((4,), "float32")])
    with pytest.raises(ktshm.KtshmError):
        device.recv(0)
    word_channel = ktshm.Channel.create(FAST)
    try:
        with pytest.raises(ktshm.KtshmError, match="device channel"):
            word_channel.device_layout(0, 0, 0, [((4,), "float32")])
    finally:
        word_channel.close()
    with pytest.raises(IndexError):
        device.device_slot(FAST.num_slots)
    with pytest.raises(ValueError, match="rows"):
        device.device_layout(0, 0, 0, [((4, 2), "float32")], rows=5)


def test_step_wait_wakes_a_sleeping_consumer_and_sees_every_reply(device, spawn_consumer, rng):
    spawn_consumer(device.name)  # spins 200 us, then sleeps on the semaphore between calls
    arrays = [rng.standard_normal((4, 16)).astype(np.float32)]
    slots = [0, 1, 2, 3]
    for slot in slots:
        offsets = device.device_layout(slot, KIND_ECHO, slot, [((4, 16), "float32")])
        fill(device, slot, offsets, arrays)
    expected = int(checksum(arrays)[0])
    for step in range(20):
        device.begin_step()
        dev = DeviceThread(device, slots)
        dev.start()
        if step % 2:
            time.sleep(0.01)  # NOTE: the consumer falls asleep before the first post
        try:
            assert ktshm.wait_device_step([device], timeout=10) is None
        finally:
            dev.stop.set()
            dev.join(5)
        assert dev.replies == [expected] * len(slots)
        assert all(device.bells(s) == (IDLE, 0) for s in slots)


def test_wait_until_called_returns_at_the_first_call_with_the_consumer_awake(device,
                                                                            spawn_consumer,
                                                                            rng):  # fmt: skip
    """until_called: back once the step's first call is posted (not before it, nor at the step's
    end: the device holds its second call until then), the consumer asleep since the last step
    woken for it; the rest of the step is waited for as ever."""
    spawn_consumer(device.name)  # spins 200 us, then sleeps on the semaphore between calls
    arrays = [rng.standard_normal((4, 16)).astype(np.float32)]
    for slot in (0, 1):
        offsets = device.device_layout(slot, KIND_ECHO, slot, [((4, 16), "float32")])
        fill(device, slot, offsets, arrays)
    with pytest.raises(ValueError, match="not both"):
        ktshm.wait_device_step([device], 1, fail_status=errors.EPEER_DIED, until_called=True)
    for step in range(5):
        device.begin_step()
        # NOTE: the consumer falls asleep before the first post (its spin is 200 us)
        go_on = threading.Event()
        dev = DeviceThread(device, [0, 1], first_call_after_s=0.01, go_on=go_on)
        dev.start()
        try:
            assert ktshm.wait_device_step([device], timeout=10, until_called=True) is None
            first_bell = device.bells(0)
            assert first_bell != (IDLE, 0) or dev.replies, f"step {step}: back before the call"
            assert u32(device.done_address).value == 0
            go_on.set()
            assert ktshm.wait_device_step([device], timeout=10) is None
            dev.join(10)
        finally:
            go_on.set()
            dev.stop.set()
            dev.join(5)
        assert dev.replies == [int(checksum(arrays)[0])] * 2


def test_step_wait_reports_an_error_reply(device):
    consumer = ktshm.Channel.attach(device.name, FAST)
    try:
        device.device_layout(1, KIND_ECHO, 0, [((1,), "float32")])
        device.begin_step()
        dev = DeviceThread(device, [1])
        dev.start()
        req = consumer.recv_request(timeout=5)
        consumer.reply_error(req, 5, "bad layer")
        assert ktshm.wait_device_step([device], timeout=10) == (errors.EREMOTE, 0, 1)
        dev.join(5)
        with pytest.raises(ktshm.RemoteError, match="bad layer"):
            device.device_reply(1)
    finally:
        consumer.close()


def test_consumer_killed_holding_a_call_then_replaced(device, spawn_consumer, rng):
    first = spawn_consumer(device.name, "--hang")
    arrays = [rng.standard_normal((2, 8)).astype(np.float32)]
    offsets = device.device_layout(0, KIND_HANG, 0, [((2, 8), "float32")])
    fill(device, 0, offsets, arrays)
    device.begin_step()
    dev = DeviceThread(device, [0])
    dev.start()
    try:
        assert first.read_line() == "took 1"
        first.proc.kill()
        start = time.monotonic()
        status, channel_index, _ = ktshm.wait_device_step([device], timeout=10)
        assert (status, channel_index) == (errors.EPEER_DIED, 0)
        assert time.monotonic() - start < 1.0, "peer death must be seen within a second"
        first.kill()
        assert device.bells(0) == (CLAIMED, 0)
        spawn_consumer(device.name)  # without --hang: it echoes
        device.wait_for_peer(timeout=10)
        assert device.resend_claimed() == [0]
        assert ktshm.wait_device_step([device], timeout=10) is None
    finally:
        dev.stop.set()
        dev.join(5)
    assert dev.replies == [int(checksum(arrays)[0])]


def test_fail_mode_answers_every_posted_bell(device):
    """No consumer at all: the host answers each call with an error so the device finishes."""
    for slot in range(3):
        device.device_layout(slot, KIND_ECHO, slot, [((1,), "float32")])
    device.begin_step()
    assert ktshm.wait_device_step([device], timeout=0.2) == (errors.EPEER_DIED, 0, 0)
    dev = DeviceThread(device, [0, 1, 2])
    dev.start()
    result = ktshm.wait_device_step([device], timeout=10, fail_status=errors.EPEER_DIED)
    dev.join(5)
    assert result == (errors.EREMOTE, 0, 0)
    assert dev.replies == [-1, -1, -1]
    device.reset_device()
    assert all(device.bells(s) == (IDLE, 0) for s in range(FAST.num_slots))


def test_superseded_consumer_reply_does_not_land(device):
    old = ktshm.Channel.attach(device.name, FAST)
    new = ktshm.Channel.attach(device.name, FAST, force=True)
    try:
        device.device_layout(0, KIND_ECHO, 0, [((1,), "float32")])
        device.ring(0)
        req = new.recv_request(timeout=5)
        assert old.reply(req, [np.ones(1, np.float32)]) is False
        assert device.bells(0) == (CLAIMED, 0)
        assert new.reply(req, [np.full(1, 2, np.float32)]) is True
        assert device.bells(0) == (CLAIMED, 1)
    finally:
        old.close()
        new.close()


def test_attach_refuses_unknown_header_flags(device):
    flags = u32(device.address + 36)  # kt_header.flags
    flags.value = 0x80
    try:
        with pytest.raises(ktshm.LayoutMismatch, match="flags"):
            ktshm.Channel.attach(device.name, FAST)
    finally:
        flags.value = 1
