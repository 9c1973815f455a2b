"""How a model's attention runs: one AttentionBackend, chosen at load (choose), frozen, and given
to the model's layers when they are built.

What is chosen once, from the device, the model and cache dtypes and the MLA latent width:
    gpu_kernels    attention_triton's kernels serve the device (CUDA, where that module imports);
                   without them the torch reference (paged_attention.py) runs every call
    flashmla       FlashMLA serves the model's MLA decode (mla_decode_flashmla.refusal: a Hopper
                   GPU, a bf16 model and cache, 576-wide latent rows, the package loads) and the
                   server allows it (KTSERVE_FLASHMLA=0): the cache is then in its 64-token blocks
    hopper_mla     mla_decode_hopper's kernel serves the MLA decode calls FlashMLA does not (a
                   Hopper GPU, Triton with Gluon)
    fused_kernels  fused_ops' Triton kernels in the layers where they apply (False: the torch
                   code only, KTSERVE_FUSED_KERNELS=0)

What each call then gets, by the kernels' own refusals (which depend on the call's shapes):
    no gpu_kernels, or heads narrower than TRITON_MIN_HEAD_DIM: the torch reference
    prefill over MLA's latent: the torch reference (long prompt chunks expand the keys instead,
        through expanded_prefill_kernel: mla_prefill.py)
    any other prefill: attention_triton.paged_prefill
    decode: FlashMLA where flashmla and the call is one it serves (call_refusal: an MLA cache of
        64-token blocks in whole contiguous pages, unit-stride query columns, no window; and a
        non-empty batch), else the Hopper kernel where hopper_mla and it takes the call
        (mla_decode_hopper.takes: heads a multiple of 64, bf16 / fp16), else attention_triton's
        split kernel
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from gpu_service.attention import mla_decode_flashmla
from gpu_service.attention.paged_attention import is_leading_view, paged_decode, paged_prefill

if TYPE_CHECKING:
    from gpu_service.attention.batch import AttentionGroup, AttentionMetadata

log = logging.getLogger("ktserve.gpu")

TRITON_MODULE = "gpu_service.attention.attention_triton"
TRITON_MIN_HEAD_DIM = 16  # attention_triton's tensor-core tiles; smaller heads (tiny test models)
DEFAULT_BLOCK_SIZE = 16  # the KV cache's block size where FlashMLA does not set it


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The GPU kernels' module, or None where it does not import (not built, no Triton)."""
    try:
        return importlib.import_module(TRITON_MODULE)
    except ImportError as exc:
        log.info("paged attention on CUDA runs the torch reference: %s does not import (%s)",
                 TRITON_MODULE, exc)  # fmt: skip
        return None


@dataclass(frozen=True)
class AttentionBackend:
    """The attention kernels of one loaded model (the module docstring's table). The default
    is the torch reference with the fused kernels on (a CPU's choice)."""

    gpu_kernels: bool = False
    flashmla: bool = False
    hopper_mla: bool = False
    fused_kernels: bool = True
    mla_decode: str = ""  # the MLA decode kernel in words, for the start-up log ("": no MLA)

    @classmethod
    def choose(
        cls,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        latent_width: int = 0,
        *,
        allow_flashmla: bool = True,
        fused_kernels: bool = True,
    ) -> AttentionBackend:
        """The backend for a model on `device` in `dtype` with a `kv_dtype` cache; latent_width:
        its MLA cache rows' width (0: no MLA). allow_flashmla=False (KTSERVE_FLASHMLA=0): never
        FlashMLA."""
        device = torch.device(device)
        kernels = triton_kernels() if device.type == "cuda" else None
        block_size, said = mla_decode_flashmla.cache_block_size(
            latent_width, device, dtype, kv_dtype, DEFAULT_BLOCK_SIZE, allow_flashmla
        )
        hopper = getattr(kernels, "mla_decode_hopper", None)
        return cls(
            gpu_kernels=kernels is not None,
            flashmla=block_size == mla_decode_flashmla.BLOCK_SIZE,
            hopper_mla=bool(latent_width)
            and hopper is not None
            and hopper.supported_device(device),
            fused_kernels=fused_kernels,
            mla_decode=said,
        )

    @property
    def block_size(self) -> int:
        """The KV cache's block size: FlashMLA's pages where it serves the decode."""
        return mla_decode_flashmla.BLOCK_SIZE if self.flashmla else DEFAULT_BLOCK_SIZE

    def kernels(self, latent: bool = False,
                head_dim: int = TRITON_MIN_HEAD_DIM) -> tuple[Callable, Callable]:  # fmt: skip
        """(decode, prefill) for a group's attention. latent: MLA's absorbed cache (values a
        view of the keys); head_dim: the smaller of the key and value head dims."""
        if self.gpu_kernels and head_dim >= TRITON_MIN_HEAD_DIM:
            prefill = paged_prefill if latent else triton_kernels().paged_prefill
            return self.gpu_decode, prefill
        return paged_decode, paged_prefill

    def gpu_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None = None,
        plans: dict | None = None,
    ) -> torch.Tensor:
        """paged_decode's contract on the GPU kernels (the decode rule of the module
        docstring). plans: where a kernel keeps what it plans from kv_len for the other calls
        over the same kv_len and block_table (AttentionGroup.plans: a step's layers)."""
        kernels = triton_kernels()
        call = kernels.check_decode(q, k_cache, v_cache, block_table, kv_len, block_size, window)
        if (
            self.flashmla
            and call.batch
            and not mla_decode_flashmla.call_refusal(q, k_cache, call.v_from_k, window, block_size)
        ):
            return mla_decode_flashmla.decode(q, k_cache, block_table, kv_len, scale, plans)
        hopper = self.hopper_mla and call.hopper_takes(q, k_cache, window)
        return kernels.split_decode(call, q, k_cache, v_cache, block_table, kv_len, block_size,
                                    scale, window, hopper=hopper)  # fmt: skip

    def expanded_prefill_kernel(self) -> Callable | None:
        """attention_triton.paged_prefill where MLA's expanded prefill runs (mla_prefill.py),
        else None (the absorbed form stays)."""
        return triton_kernels().paged_prefill if self.gpu_kernels else None

    def attend_group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        block_size: int,
        scale: float,
        window: int | None = None,
        *,
        prefill: bool,
    ) -> torch.Tensor:
        """One group's attention, q [n, Hq, D] (its rows) -> [n, Hq, Dv], through the decode or
        the prefill kernel `kernels` gives it (latent: v_cache a leading view of k_cache)."""
        latent = is_leading_view(v_cache, k_cache)
        head_dim = min(q.shape[-1], v_cache.shape[-1])
        decode, prefill_kernel = self.kernels(latent, head_dim)
        if prefill:
            return prefill_kernel(q, k_cache, v_cache, group.block_table, group.cu_seqlens_q,
                                  group.kv_len, block_size, scale, window)  # fmt: skip
        return decode(q, k_cache, v_cache, group.block_table, group.kv_len, block_size, scale,
                      window, plans=group.plans)  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """A step's attention, q [T, Hq, D] -> [T, Hq, Dv]: each of the metadata's decode groups
        and its prefill group through their kernel, one call per group, the new tokens' K/V
        already in the cache."""
        groups = [(group, False) for group in meta.decodes]
        if meta.prefill is not None:
            groups.append((meta.prefill, True))
        args = (k_cache, v_cache)
        if len(groups) == 1:  # its rows are all of T
            ((group, prefill),) = groups
            return self.attend_group(q, *args, group, meta.block_size, scale, window,
                                     prefill=prefill)  # fmt: skip
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))  # [T, Hq, Dv]
        for group, prefill in groups:
            out[group.rows] = self.attend_group(q[group.rows], *args, group, meta.block_size,
                                                scale, window, prefill=prefill)  # fmt: skip
        return out
