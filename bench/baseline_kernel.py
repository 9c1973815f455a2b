"""Another source tree's build of the kernel extension, loaded beside this tree's in one process, so
that a benchmark can alternate the two kernels call by call on the same packed weights (the same
memory, the same routings) instead of comparing two processes, whose timings of the same code drift
apart (expert_service/kernels/README.md has the spread). The tree's packed layout must be this
tree's: the benchmark checks the two outputs agree before it times them. A process loads one file
once: the extension this tree imports cannot also be its own baseline (a copy of it can). Several
trees load side by side, each under a module name of its own (`index`).

    ext = load_kernel_ext(Path("/tmp/base-tree"))   # its extensions built in place
    with MoEKernel(15, ext=ext) as baseline: ...
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

MODULE_NAME = "ktserve_baseline_kernel._ext"  # the last part names the init function: PyInit__ext


def module_name(index: int) -> str:
    """The module name of the index-th baseline tree's extension (0: MODULE_NAME)."""
    return MODULE_NAME if index == 0 else MODULE_NAME.replace("._ext", f"{index}._ext")


def load_kernel_ext(tree: Path, index: int = 0) -> ModuleType:
    """The `expert_service.kernels._ext` extension built in place in `tree`, as a module of its
    own (this tree's stays what `expert_service.kernels` imports; several trees: a distinct
    `index` each). Raises FileNotFoundError, with what to run, where it is not built."""
    folder = Path(tree) / "expert_service" / "kernels"
    found = [folder / f"_ext{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    found = [path for path in found if path.is_file()]
    if not found:
        raise FileNotFoundError(
            f"no built kernel extension in {folder} (build it there: python setup.py build_ext "
            "--inplace)"
        )
    spec = importlib.util.spec_from_file_location(module_name(index), found[0])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {found[0]}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
