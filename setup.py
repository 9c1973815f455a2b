"""Build steps pyproject.toml cannot express: the Cython/C++ extensions and the gRPC stubs.

Generated protobuf/gRPC modules are written next to the sources (ktserve/protocol/) before
the packages are collected, so editable and regular installs see the same tree; they are ignored
by git and never committed.
"""

from __future__ import annotations

import os
import pathlib

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto" / "ktserve" / "v1"
# NOTE: protoc's virtual path maps proto/ktserve/v1/x.proto onto ktserve/protocol/x.proto,
# so the generated modules import each other as `ktserve.protocol.x_pb2`.
PROTO_PACKAGE_DIR = "ktserve/protocol"


def generate_protos() -> None:
    protos = sorted(PROTO_ROOT.glob("*.proto"))
    if not protos:
        return
    import grpc_tools
    from grpc_tools import protoc

    out_dir = ROOT / PROTO_PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_PACKAGE_DIR}={PROTO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
    ] + [f"{PROTO_PACKAGE_DIR}/{p.name}" for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""gRPC/protobuf modules generated from proto/ktserve/v1."""\n')


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


class EggInfoWithProtos(egg_info):
    def run(self) -> None:
        generate_protos()
        super().run()


def extensions() -> list[Extension]:
    exts = [
        Extension(
            "ktshm.channel",
            sources=["ktshm/channel.pyx"],
            include_dirs=["ktshm", numpy.get_include()],
            extra_compile_args=["-O2", "-std=c11"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ),
    ]
    # --- kernel extensions (expert_service/kernels) are appended below ---
    kdir = "expert_service/kernels"
    exts.append(
        Extension(
            "expert_service.kernels._ext",
            sources=[f"{kdir}/_ext.pyx"] + [f"{kdir}/{name}" for name in KERNEL_SOURCES],
            include_dirs=[kdir],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fno-plt"],
            extra_link_args=["-lpthread"],
        )
    )
    return cythonize(exts, language_level=3, compiler_directives={"boundscheck": False})


# One translation unit per instruction set, each compiled with its own flags (see BuildExtPerIsa).
KERNEL_ISA_FLAGS = {
    "ktk_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "ktk_avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                       "-mavx512bf16", "-mavx512vnni"],
    "ktk_amx.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}  # fmt: skip
KERNEL_SOURCES = ["ktk_cpu.cpp", "ktk_pool.cpp", "ktk_pack.cpp", "ktk_moe.cpp", *KERNEL_ISA_FLAGS]
# Tests only (tests/expert_service/test_amx_emulated.py): KTSERVE_KERNEL_AMX_EMULATE=1 builds the
# AMX unit on software tiles (ktk_amx_emu.h), so its logic runs on any AVX-512 CPU.
AMX_EMULATE_ENV = "KTSERVE_KERNEL_AMX_EMULATE"
if os.environ.get(AMX_EMULATE_ENV) == "1":
    KERNEL_ISA_FLAGS["ktk_amx.cpp"] = [
        f for f in KERNEL_ISA_FLAGS["ktk_amx.cpp"] if not f.startswith("-mamx")
    ] + ["-DKTK_AMX_EMULATE"]
    KERNEL_ISA_FLAGS["ktk_cpu.cpp"] = ["-DKTK_AMX_EMULATE"]


class BuildExtPerIsa(build_ext):
    """Adds KERNEL_ISA_FLAGS to the compile of the matching source file only."""

    def build_extensions(self) -> None:
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs) + KERNEL_ISA_FLAGS.get(pathlib.Path(src).name, [])
            compile_one(obj, src, ext, cc_args, extra, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


setup(
    ext_modules=extensions(),
    cmdclass={
        "build_py": BuildPyWithProtos,
        "egg_info": EggInfoWithProtos,
        "build_ext": BuildExtPerIsa,
    },
)
