"""MLA decode through FlashMLA (DeepSeek's Hopper kernel; the `sgl-flash-mla` package), where it
is installed and serves the call.

FlashMLA's dense decode (the package's legacy, SM90 kernels) attends each sequence's query
[H, 576] to a paged latent cache of 64-token pages [pages, 64, 1, 576], reads the first 512
columns of a row as its value, and merges its own splits. It plans the splits from the
sequences' lengths on the device, in a kernel of its own inside the call given an empty schedule,
so a call captured in a CUDA graph serves every replay's kv_len; a step's other layers are given
the filled schedule and plan nothing (AttentionGroup.plans). Both are checked on a Hopper GPU
(tests/gpu_service/attention/test_mla_decode_flashmla.py). A warp-specialized kernel of its kind
is what MLA decode needs at 128 heads, where the step is bound by the tensor cores as much as by
HBM (mla_decode_hopper's docstring; docs/attention.md: "FlashMLA, where it is installed").

It takes only what its kernel takes: a bf16 cache of 64-token blocks read as key and value, bf16
queries, no window, a Hopper GPU (sm_90). A model's AttentionBackend (backend.py) takes it at
load where it serves the model, and the server makes its cache blocks 64 tokens then
(cache_block_size); everywhere else attention_triton's kernels run.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

BLOCK_SIZE = 64  # FlashMLA's page: "Currently page_block_size must be 64"
HEAD_DIM = 576  # latent 512 + rope 64
VALUE_DIM = 512
DTYPE = torch.bfloat16
PACKAGE = "sgl-flash-mla"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    """(flash_mla with its SM90 kernels, "") or (None, why not)."""
    try:
        import flash_mla
    except ImportError:
        return None, f"{PACKAGE} is not installed"
    except Exception as exc:  # installed, but it does not load here (its extensions, its torch)
        return None, f"{PACKAGE} does not load: {type(exc).__name__}: {exc}"
    version = getattr(flash_mla, "__version__", "?")
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        return None, f"{PACKAGE} {version} has no SM90 (legacy) kernels"
    return flash_mla, ""


def library() -> ModuleType | None:
    return _load()[0]


def unavailable_reason() -> str:
    """Why FlashMLA cannot run in this process ("" where it can)."""
    return _load()[1]


@functools.lru_cache(maxsize=4)
def supported_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def refusal(device, query_dtype: torch.dtype, cache_dtype: torch.dtype, latent_width: int) -> str:
    """Why FlashMLA cannot serve an MLA model's decode here, with these dtypes and cache rows
    latent_width wide ("" where it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not on a CUDA device"
    if not supported_device(device):
        return "FlashMLA's kernels here are built for Hopper (sm_90)"
    if latent_width != HEAD_DIM:
        return f"FlashMLA takes {HEAD_DIM}-wide latent rows, this model's are {latent_width}"
    if query_dtype != DTYPE or cache_dtype != DTYPE:
        return f"FlashMLA takes a bf16 model and cache, not {query_dtype} / {cache_dtype}"
    return unavailable_reason()


def cache_block_size(latent_width: int, device, query_dtype: torch.dtype,
                     cache_dtype: torch.dtype, default: int,
                     allowed: bool = True) -> tuple[int, str]:  # fmt: skip
    """The KV cache's block size for a model whose MLA cache rows are latent_width wide (0: no
    MLA), and the MLA decode kernel that leads to, in words for the start-up log ("" without
    MLA). allowed=False (KTSERVE_FLASHMLA=0): never FlashMLA."""
    if not latent_width:
        return default, ""
    why = (
        refusal(device, query_dtype, cache_dtype, latent_width)
        if allowed
        else "FlashMLA off: KTSERVE_FLASHMLA=0"
    )
    if why:
        return default, f"ktserve's own kernels ({why})"
    return BLOCK_SIZE, f"FlashMLA ({PACKAGE}), {BLOCK_SIZE}-token cache blocks"


def call_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_from_k: bool, window,
                 block_size: int) -> str:  # fmt: skip
    """Why this does not serve a decode call (q [B, H, 576], k_cache [S, 1, 576] read as key and
    value; "" where it does)."""
    if not v_from_k or k_cache.shape[1] != 1:
        return "not an MLA cache (one latent row read as key and value)"
    if window is not None:
        return "a sliding window"
    if block_size != BLOCK_SIZE:
        return f"{block_size}-token blocks"
    if k_cache.shape[0] % BLOCK_SIZE or not k_cache.is_contiguous():
        return "a cache not laid out in whole contiguous pages"
    if q.stride(-1) != 1:
        return "a query with strided columns"
    return refusal(q.device, q.dtype, k_cache.dtype, k_cache.shape[-1])


def decode_checked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_table: torch.Tensor, kv_len: torch.Tensor, block_size: int, scale: float,
                   window: int | None = None,
                   plans: dict | None = None) -> torch.Tensor:  # fmt: skip
    """decode for a caller that names this kernel (tests, benchmarks; the caches as
    attention_triton.check_decode takes them): a ValueError that says what it takes where
    call_refusal refuses the call."""
    from gpu_service.attention.attention_triton import check_decode

    call = check_decode(q, k_cache, v_cache, block_table, kv_len, block_size, window)
    refused = call_refusal(q, k_cache, call.v_from_k, window, block_size)
    if refused:
        raise ValueError(
            "FlashMLA takes bf16 MLA caches of 64-token blocks (576-wide latent rows read as "
            f"key and value, no window) on a Hopper GPU (sm_90) with {PACKAGE} installed; "
            f"here: {refused}"
        )
    if not call.batch:
        return q.new_empty((0, call.num_heads, VALUE_DIM))
    return decode(q, k_cache, block_table, kv_len, scale, plans)


def decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
           kv_len: torch.Tensor, scale: float,
           plans: dict | None = None) -> torch.Tensor:  # fmt: skip
    """q [B, H, 576] bf16 (each sequence's query at position kv_len - 1), k_cache [S, 1, 576]
    of 64-token blocks, block_table [B, W] and kv_len [B] int32 -> [B, H, 512] bf16. plans:
    where the split schedule made by the first call is kept for the others over the same kv_len
    (a step's layers: AttentionGroup.plans); None makes one for this call alone."""
    flash_mla = library()
    if flash_mla is None:  # NOTE: callers ask call_refusal first; this is for those that do not
        raise RuntimeError(f"FlashMLA cannot run here: {unavailable_reason()}")
    batch, heads, _ = q.shape
    pages = k_cache.view(-1, BLOCK_SIZE, 1, HEAD_DIM)
    # NOTE: an empty schedule is filled by the call it is given to: the kernel plans its splits
    # from kv_len on the device, inside the call (and so inside a captured graph, at every
    # replay); later calls given the filled one read it and plan nothing
    key = ("flashmla", batch, heads)
    schedule = plans.get(key) if plans is not None else None
    if schedule is None:
        schedule, _ = flash_mla.get_mla_metadata()
        if plans is not None:
            plans[key] = schedule
    out, _ = flash_mla.flash_mla_with_kvcache(
        q.reshape(batch, 1, heads, HEAD_DIM), pages, block_table, kv_len, VALUE_DIM, schedule,
        softmax_scale=scale, causal=False, use_legacy=True,
    )  # fmt: skip
    return out.view(batch, heads, VALUE_DIM)
