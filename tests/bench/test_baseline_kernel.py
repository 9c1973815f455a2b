"""bench/baseline_kernel.py and bench_moe_kernel's baseline check: another build of the kernel
extension runs beside this one in one process, on the same packed weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from bench.baseline_kernel import MODULE_NAME, load_kernel_ext
from bench.bench_moe_kernel import baseline_agrees, baseline_exts
from expert_service.kernels import MoEKernel, _ext, pack_experts

E, H, I, T, K = 8, 128, 64, 24, 2  # noqa: E741


@pytest.fixture
def layer(seed):
    gen = torch.Generator().manual_seed(seed)
    dims = ((E, I, H), (E, I, H), (E, H, I))  # gate, up, down
    weights = [torch.randn(*d, generator=gen) * 0.05 for d in dims]
    packed = pack_experts(*weights, "int4")
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=gen)
    return packed, x, (ids, w)


def test_another_build_runs_beside_this_one_and_gives_the_same_output(layer, tmp_path):
    packed, x, (ids, w) = layer
    # a copy of this tree's build in a tree of its own (one file is loaded once per process)
    folder = tmp_path / "expert_service" / "kernels"
    folder.mkdir(parents=True)
    shutil.copy(_ext.__file__, folder)
    ext = load_kernel_ext(tmp_path)
    assert ext is not _ext and ext.__name__ == MODULE_NAME
    ours, theirs = torch.empty(T, H), torch.empty(T, H)
    with MoEKernel(2) as kern, MoEKernel(2, ext=ext) as other:
        kern.forward(packed, x, ids, w, ours)
        other.forward(packed, x, ids, w, theirs)
        assert baseline_agrees(other, kern, packed, x, (ids, w), "this tree twice")
    assert torch.equal(ours, theirs)  # the same code on the same weights: bit for bit
    assert ours.abs().sum() > 0


def _copy_of_this_build(tree):
    folder = tree / "expert_service" / "kernels"
    folder.mkdir(parents=True)
    shutil.copy(_ext.__file__, folder)
    return tree


def test_several_builds_load_side_by_side_each_labelled_by_its_folder(layer, tmp_path):
    packed, x, (ids, w) = layer
    trees = [str(_copy_of_this_build(tmp_path / name)) for name in ("kernel-a", "kernel-b")]
    loaded = baseline_exts(trees)
    assert [label for label, _ in loaded] == ["baseline:kernel-a", "baseline:kernel-b"]
    first, second = (ext for _, ext in loaded)
    assert first is not second and first.__name__ != second.__name__
    outs = [torch.empty(T, H) for _ in range(3)]
    with MoEKernel(2) as kern, MoEKernel(2, ext=first) as a, MoEKernel(2, ext=second) as b:
        for kernel, out in zip((kern, a, b), outs):
            kernel.forward(packed, x, ids, w, out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_one_build_keeps_the_plain_label_and_clashing_folders_are_refused(tmp_path):
    one = _copy_of_this_build(tmp_path / "one")
    assert [label for label, _ in baseline_exts([str(one)])] == ["baseline"]
    with pytest.raises(SystemExit, match="distinct folder names"):
        baseline_exts([str(one), str(tmp_path / "elsewhere" / "one")])


class _OtherLayout:
    """A kernel that reads the packed weights as another layout would: nothing like ours."""

    def forward(self, packed, x, ids, w, out) -> None:
        out.copy_(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))


def test_a_baseline_whose_output_differs_is_not_timed(layer):
    packed, x, route = layer
    with MoEKernel(2) as kern:
        assert not baseline_agrees(_OtherLayout(), kern, packed, x, route, "another layout")


def test_an_unbuilt_tree_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_ext --inplace"):
        load_kernel_ext(tmp_path)
