"""ktshm's trust boundary: the segment is the peer's input. A consumer attaches only to segments of
its own uid that nobody else can open, keeps the geometry it validated at attach in private
memory (a header rewritten afterwards moves no access), and other users cannot open segments."""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import subprocess
import uuid

import numpy as np
import pytest

import ktshm
from tests.support.consumer_proc import KIND_ECHO, checksum

FAST = ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16, spin_us=50, peer_timeout_s=0.3)
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def producer():
    ch = ktshm.Channel.create(FAST)
    yield ch
    ch.close()


def test_attach_refuses_a_segment_others_can_open(producer):
    path = f"/dev/shm/{producer.name}"
    os.chmod(path, 0o644)
    try:
        with pytest.raises(ktshm.UntrustedSegment, match="0600"):
            ktshm.Channel.attach(producer.name, FAST)
    finally:
        os.chmod(path, 0o600)
    ktshm.Channel.attach(producer.name, FAST).close()


@pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
def test_attach_refuses_a_segment_of_another_user(producer):
    path = f"/dev/shm/{producer.name}"
    os.chown(path, 65534, -1)
    try:
        with pytest.raises(ktshm.UntrustedSegment, match="uid 65534"):
            ktshm.Channel.attach(producer.name, FAST)
    finally:
        os.chown(path, 0, -1)


def test_a_header_rewritten_after_attach_moves_no_access(producer, spawn_consumer, rng):
    """The consumer (another process) validated the geometry at attach; the producer's side then
    claims 4096 slots of a huge stride. Both ends go on with what they validated: the round trip
    is correct and the consumer is alive."""
    consumer = spawn_consumer(producer.name)
    header = producer.address
    ctypes.c_uint32.from_address(header + 12).value = 4096  # num_slots
    ctypes.c_uint64.from_address(header + 16).value = 1 << 40  # region_bytes
    ctypes.c_uint64.from_address(header + 24).value = (1 << 40) * 2 + 512  # slot_stride
    arrays = [rng.standard_normal((3, 8)).astype(np.float32)]
    for layer in range(2 * FAST.num_slots):  # every slot, twice
        out = producer.call(KIND_ECHO, layer, arrays, timeout=10)
        np.testing.assert_array_equal(out[0], arrays[0])
        assert int(out[-1][0]) == int(checksum(arrays)[0])
    assert consumer.proc.poll() is None, "the consumer crashed"


def _other_user() -> str | None:
    if not IS_ROOT or shutil.which("useradd") is None:
        return None
    name = f"ktsu{uuid.uuid4().hex[:8]}"
    done = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)  # fmt: skip
    return name if done.returncode == 0 else None


@pytest.mark.skipif(not IS_ROOT, reason="creating a user needs root")
def test_another_user_cannot_open_the_segment_or_its_semaphores(producer):
    user = _other_user()
    if user is None:
        pytest.skip("useradd is not available or failed")
    try:
        uid = pwd.getpwnam(user).pw_uid
        probe = (  # plain files: the other user's Python may not reach ktserve's environment
            "import sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        open(path, 'rb').close()\n"
            "        print('opened')\n"
            "    except PermissionError:\n"
            "        print('refused')\n"
        )
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None:
            pytest.skip("no system python3 for the other user")
        paths = [f"/dev/shm/{producer.name}", f"/dev/shm/sem.{producer.name}.req",
                 f"/dev/shm/sem.{producer.name}.rep"]  # fmt: skip
        assert all(os.path.exists(p) for p in paths)
        done = subprocess.run([python, "-I", "-c", probe, *paths], user=uid, cwd="/",
                              env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["refused"] * 3
    finally:
        subprocess.run(["userdel", user], capture_output=True)
        assert user not in {u.pw_name for u in pwd.getpwall()}, "the test user is left behind"
