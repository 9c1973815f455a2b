"""A worker that packs a checkpoint at load keeps the packed experts in a 0700 store under
/dev/shm, reports it (GetInfo), and removes it when it exits; a killed worker's store is removed
by the next one to create a store; a `ktserve convert` directory is reported as it is and never
removed. Real `ktserve expert` subprocesses."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ktshm
from expert_service.shard import load_shard
from ktserve import shared_store
from ktserve.protocol import expert_pb2 as pb
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401
from tests.support.watched_process import CHILD_ENV, REPO

CHECKPOINT = TinyCheckpoint("qwen3_moe")


def info(worker: ExpertProcess) -> pb.WorkerInfo:
    return worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10)


def test_store_holds_the_packed_experts_and_goes_at_exit(checkpoint):
    worker = ExpertProcess("--model", str(checkpoint), "--format", "int4", "--experts", "2-7")
    try:
        store = info(worker).store
        path = Path(store.dir)
        assert path.parent == Path("/dev/shm") and shared_store.is_store_name(path.name)
        st = path.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700
        assert st.st_uid == os.geteuid()
        want = load_shard(checkpoint, range(2, 8), "int4", pack_threads=1)  # private, in-process
        assert {entry.layer for entry in store.layers} == set(want.layers)
        for entry in store.layers:
            data = (path / entry.file).read_bytes()
            for t in entry.tensors:
                arr = want.layers[entry.layer].tensors[t.name]
                got = np.frombuffer(data, np.dtype(t.dtype), arr.size, t.offset)
                np.testing.assert_array_equal(got.reshape(arr.shape), arr)
        assert worker.terminate() == 0
        assert not path.exists()
    finally:
        worker.close()


def test_a_killed_workers_store_goes_with_the_next_store(checkpoint):
    first = ExpertProcess("--model", str(checkpoint), "--format", "int8")
    second = None
    try:
        path = Path(info(first).store.dir)
        first.kill()
        assert path.is_dir()  # nobody removed it
        second = ExpertProcess("--model", str(checkpoint), "--format", "int8")
        assert not path.exists()
        alive = Path(info(second).store.dir)
        assert shared_store.cleanup_stale() == [] and alive.is_dir()  # a live one stays
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_store_being_made_is_not_taken_for_a_dead_workers():
    """A store whose owner file is not written yet (another worker's cleanup ran between its
    mkdir and that write: once seen in CI, with two workers starting side by side) stays while
    the pid in its name runs, and goes once it does not."""
    prefix = f"{shared_store.ROOT}/{ktshm.name_prefix()}{shared_store.MARK}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    making = Path(f"{prefix}{os.getpid()}.{secrets.token_hex(8)}")
    gone = Path(f"{prefix}{int(dead.stdout)}.{secrets.token_hex(8)}")
    try:
        for path in (making, gone):
            path.mkdir(mode=0o700)
        removed = shared_store.cleanup_stale()
        assert making.is_dir() and making.name not in removed
        assert not gone.exists() and gone.name in removed
    finally:
        for path in (making, gone):
            shared_store.remove(path)


def test_no_share_experts_keeps_them_private(checkpoint):
    worker = ExpertProcess("--model", str(checkpoint), "--format", "int8", "--no-share-experts")
    try:
        assert not info(worker).HasField("store")
    finally:
        worker.close()


def test_a_converted_directory_is_the_store(checkpoint, tmp_path):
    out = tmp_path / "packed"
    result = subprocess.run(
        [sys.executable, "-m", "ktserve", "convert", "--model", str(checkpoint),
         "--out", str(out), "--format", "bf16", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, env=CHILD_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    worker = ExpertProcess("--model", str(out), "--format", "bf16")
    try:
        store = info(worker).store
        assert Path(store.dir) == out.resolve()
        assert {e.file for e in store.layers} <= set(os.listdir(out))
        assert worker.terminate() == 0
        assert out.is_dir() and len(store.layers) > 0  # not the worker's to remove
    finally:
        worker.close()


@pytest.mark.parametrize("fp8, per_expert_names", [(True, True), (False, False)])
def test_packed_into_the_store_equals_packed_in_memory(fp8, per_expert_names, tmp_path, seed):
    """FP8 experts (dequantized while packing) and a fused layout (through float32), packed in
    place into the store's files: the same bytes as a private load."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "c", seed=seed, fp8=fp8,
                                per_expert_names=per_expert_names)  # fmt: skip
    shared = load_shard(path, range(1, 9), "int4", pack_threads=1, share=True)
    try:
        assert shared.store is not None and Path(shared.store.dir).parent == Path("/dev/shm")
        private = load_shard(path, range(1, 9), "int4", pack_threads=1)
        for layer, packed in private.layers.items():
            for name, arr in packed.tensors.items():
                got = shared.layers[layer].tensors[name]
                assert not got.flags.writeable
                np.testing.assert_array_equal(got, arr)
    finally:
        shared_store.remove(Path(shared.store.dir))
