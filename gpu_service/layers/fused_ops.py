"""One CUDA kernel each for RMSNorm and the rotary embedding (Triton), where torch runs 6-8.

At decode batch 1 a layer's GPU part is launch-bound: its kernels, most of them tiny
elementwise steps of RMSNorm's float32 math and of RoPE, cost more in their gaps than in their
work. These kernels compute what the torch code in layers.py / rope.py computes (the oracle; it
stays the CPU path), in the same float32 steps and with the same roundings:
    rms_norm: y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)        over the last dim
    rotary:   [x1 c - x2 s | x2 c + x1 s].to(x.dtype), (x1, x2) = halves or even/odd elements
And the routers after their gate GEMM, one kernel per token row (moe.py's routers are the
oracle): softmax_topk (Qwen-MoE, Mixtral, DeepSeek-V2 greedy: softmax in float32, top-k, renorm,
scaling) and grouped_sigmoid_topk (DeepSeek-V3: sigmoid, the bias for choosing only, top-2-sum
group scores, the best topk_group groups, top-k, renorm, scaling). Ties go to the lower expert id.
add_rms_norm: a residual add and the norm after it (the sum rounded as the torch code rounds it).
And GQA's steps between its projections and the paged attention, one kernel for all heads of a
step (qk_rope_cache: Qwen3's per-head q/k RMSNorm, RoPE, k and v written into the cache at
their slots), where torch runs 6-8 launches; and MLA's (mla_rope_cache: the latent's RMSNorm,
RoPE of the query's and the key's rotary parts, the latent row written into the cache), where
torch runs five. `supports(...)` says when a tensor can take
them (CUDA, Triton importable, unit last stride); otherwise callers keep the torch code, as they
do where their model's AttentionBackend has `fused_kernels` off (KTSERVE_FUSED_KERNELS=0), a choice
the layers are given when they are built.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the torch code runs everywhere
    triton = None


def supports(*tensors: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)


if triton is not None:

    @triton.jit
    def _normalized(x, inv, w, kind: tl.constexpr):
        """RMSNorm's last steps, rounded where the torch code rounds: w * (x inv).to(kind)."""
        return (w.to(tl.float32) * (x * inv).to(kind).to(tl.float32)).to(kind)

    @triton.jit
    def _rotated(x1, x2, c, s, kind: tl.constexpr):
        """The rotary embedding of the halves (x1, x2) by cos / sin, each rounded to kind."""
        return (x1 * c - x2 * s).to(kind), (x2 * c + x1 * s).to(kind)

    @triton.jit
    def _rms_norm_row(x, w_ptr, cols, mask, dim, eps, kind: tl.constexpr):
        """A row x [BLOCK] float32 (0 past dim) RMSNorm'd by w."""
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        return _normalized(x, inv, tl.load(w_ptr + cols, mask=mask), kind)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        normed = _rms_norm_row(x, w_ptr, cols, mask, dim, eps, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * dim + cols, normed, mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, h_row_stride, d_row_stride,
                             dim, eps, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        kind = out_ptr.dtype.element_ty
        h = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * d_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (h + d).to(kind)
        tl.store(sum_ptr + row * dim + cols, x, mask=mask)
        normed = _rms_norm_row(x.to(tl.float32), w_ptr, cols, mask, dim, eps, kind)
        tl.store(out_ptr + row * dim + cols, normed, mask=mask)

    @triton.jit
    def _rope_halves(src, cos_ptr, sin_ptr, t, half, kind: tl.constexpr,
                     INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """The rotated halves of one head's rotary part at src (even/odd elements when
        INTERLEAVED), by token t's cos/sin, each rounded to kind."""
        i = tl.arange(0, BLOCK)
        mask = i < half
        if INTERLEAVED:
            x1 = tl.load(src + 2 * i, mask=mask).to(tl.float32)
            x2 = tl.load(src + 2 * i + 1, mask=mask).to(tl.float32)
        else:
            x1 = tl.load(src + i, mask=mask).to(tl.float32)
            x2 = tl.load(src + half + i, mask=mask).to(tl.float32)
        c = tl.load(cos_ptr + t * half + i, mask=mask)
        s = tl.load(sin_ptr + t * half + i, mask=mask)
        return _rotated(x1, x2, c, s, kind)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, heads,
                       half, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        t, h = pid // heads, pid % heads
        i = tl.arange(0, BLOCK)
        mask = i < half
        src = x_ptr + t * x_token_stride + h * x_head_stride
        r1, r2 = _rope_halves(src, cos_ptr, sin_ptr, t, half, out_ptr.dtype.element_ty,
                              INTERLEAVED, BLOCK)  # fmt: skip
        dst = out_ptr + (t * heads + h) * 2 * half
        tl.store(dst + i, r1, mask=mask)
        tl.store(dst + half + i, r2, mask=mask)


if triton is not None:

    @triton.jit
    def _norm_rope_head(src, w_ptr, cos_ptr, sin_ptr, t, half, eps, kind: tl.constexpr,
                        NORM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """One head's [x1 | x2] (halves of D = 2 half at src), RMSNorm'd by w when NORM, then
        rotated by token t's cos/sin: the two halves in float32, each rounded where the torch
        code rounds (to `kind`)."""
        i = tl.arange(0, BLOCK)
        mask = i < half
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
            x1 = _normalized(x1, inv, tl.load(w_ptr + i, mask=mask), kind).to(tl.float32)
            x2 = _normalized(x2, inv, tl.load(w_ptr + half + i, mask=mask), kind).to(tl.float32)
        c = tl.load(cos_ptr + t * half + i, mask=mask)
        s = tl.load(sin_ptr + t * half + i, mask=mask)
        return _rotated(x1, x2, c, s, kind)

    @triton.jit
    def _qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr,
                              q_out, k_cache, v_cache, q_ts, q_hs, k_ts, k_hs, v_ts, v_hs,
                              kc_ss, kc_hs, vc_ss, vc_hs, heads_q, heads_kv, half, eps,
                              NORM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        # one program per (token, head) of q, then of k (with v): [Hq heads | Hkv heads]
        pid = tl.program_id(0)
        t, h = pid // (heads_q + heads_kv), pid % (heads_q + heads_kv)
        kind = q_out.dtype.element_ty
        i = tl.arange(0, BLOCK)
        mask = i < half
        if h < heads_q:
            src = q_ptr + t * q_ts + h * q_hs
            r1, r2 = _norm_rope_head(src, qw_ptr, cos_ptr, sin_ptr, t, half, eps, kind, NORM,
                                     BLOCK)  # fmt: skip
            dst = q_out + (t * heads_q + h) * 2 * half
            tl.store(dst + i, r1, mask=mask)
            tl.store(dst + half + i, r2, mask=mask)
        else:
            kh = h - heads_q
            slot = tl.load(slots_ptr + t).to(tl.int64)
            src = k_ptr + t * k_ts + kh * k_hs
            r1, r2 = _norm_rope_head(src, kw_ptr, cos_ptr, sin_ptr, t, half, eps, kind, NORM,
                                     BLOCK)  # fmt: skip
            cache_kind = k_cache.dtype.element_ty
            dst = k_cache + slot * kc_ss + kh * kc_hs
            tl.store(dst + i, r1.to(cache_kind), mask=mask)
            tl.store(dst + half + i, r2.to(cache_kind), mask=mask)
            j = tl.arange(0, 2 * BLOCK)
            vmask = j < 2 * half
            v = tl.load(v_ptr + t * v_ts + kh * v_hs + j, mask=vmask)
            vdst = v_cache + slot * vc_ss + kh * vc_hs
            tl.store(vdst + j, v.to(v_cache.dtype.element_ty), mask=vmask)

    @triton.jit
    def _mla_rope_cache_kernel(q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, q_out, cache,
                               q_ts, q_hs, kv_ts, cache_ss, heads, rank, half, eps,
                               INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr,
                               BLOCK_R: tl.constexpr):  # fmt: skip
        # one program per (token, head) of q's rotary part, then one per token for its cache row
        pid = tl.program_id(0)
        t, h = pid // (heads + 1), pid % (heads + 1)
        kind = q_out.dtype.element_ty
        i = tl.arange(0, BLOCK)
        mask = i < half
        if h < heads:
            r1, r2 = _rope_halves(q_ptr + t * q_ts + h * q_hs, cos_ptr, sin_ptr, t, half, kind,
                                  INTERLEAVED, BLOCK)  # fmt: skip
            dst = q_out + (t * heads + h) * 2 * half
            tl.store(dst + i, r1, mask=mask)
            tl.store(dst + half + i, r2, mask=mask)
        else:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            row = kv_ptr + t * kv_ts
            j = tl.arange(0, BLOCK_R)
            rmask = j < rank
            x = tl.load(row + j, mask=rmask, other=0.0).to(tl.float32)
            latent = _rms_norm_row(x, w_ptr, j, rmask, rank, eps, kind)
            cache_kind = cache.dtype.element_ty
            dst = cache + slot * cache_ss
            tl.store(dst + j, latent.to(cache_kind), mask=rmask)
            r1, r2 = _rope_halves(row + rank, cos_ptr, sin_ptr, t, half, kind, INTERLEAVED,
                                  BLOCK)  # fmt: skip
            tl.store(dst + rank + i, r1.to(cache_kind), mask=mask)
            tl.store(dst + rank + half + i, r2.to(cache_kind), mask=mask)

    @triton.jit
    def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, row_stride, num_experts, scaling,
                             K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                             RENORM: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < num_experts
        raw = tl.load(logits_ptr + row * row_stride + offs, mask=valid, other=float("-inf"))
        x = raw.to(tl.float32)
        e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
        probs = e / tl.sum(e, axis=0)
        work = tl.where(valid, probs, -1.0)
        kk = tl.arange(0, KP)
        vals = tl.zeros((KP,), tl.float32)
        idxs = tl.zeros((KP,), tl.int32)
        for j in tl.static_range(K):
            best = tl.max(work, axis=0)
            at = tl.min(tl.where(work == best, offs, BLOCK), axis=0)
            vals = tl.where(kk == j, best, vals)
            idxs = tl.where(kk == j, at, idxs)
            work = tl.where(offs == at, -2.0, work)
        if RENORM:
            vals = vals / tl.sum(tl.where(kk < K, vals, 0.0), axis=0)
        if ROUND:
            vals = vals.to(raw.dtype).to(tl.float32)
        tl.store(ids_ptr + row * K + kk, idxs, mask=kk < K)
        tl.store(weights_ptr + row * K + kk, vals * scaling, mask=kk < K)

    @triton.jit
    def _grouped_sigmoid_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, row_stride,
                                     scaling, G: tl.constexpr, EG: tl.constexpr,
                                     TOPK_GROUPS: tl.constexpr, K: tl.constexpr,
                                     KP: tl.constexpr, RENORM: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        g = tl.arange(0, G)
        c = tl.arange(0, EG)
        flat = g[:, None] * EG + c[None, :]  # [G, EG]: expert ids
        scores = tl.sigmoid(tl.load(logits_ptr + row * row_stride + flat).to(tl.float32))
        choice = scores + tl.load(bias_ptr + flat)
        first = tl.max(choice, axis=1)  # [G]
        first_at = tl.min(tl.where(choice == first[:, None], c[None, :], EG), axis=1)
        second = tl.max(tl.where(c[None, :] == first_at[:, None], float("-inf"), choice), axis=1)
        group_scores = first + second
        chosen = tl.zeros((G,), tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(tl.where(chosen == 1, float("-inf"), group_scores), axis=0)
            at = tl.min(tl.where((group_scores == best) & (chosen == 0), g, G), axis=0)
            chosen = tl.where(g == at, 1, chosen)
        work = tl.where(chosen[:, None] == 1, choice, float("-inf"))
        kk = tl.arange(0, KP)
        vals = tl.zeros((KP,), tl.float32)
        idxs = tl.zeros((KP,), tl.int32)
        for j in tl.static_range(K):
            best = tl.max(tl.max(work, axis=1), axis=0)
            at = tl.min(tl.min(tl.where(work == best, flat, G * EG), axis=1), axis=0)
            score = tl.sum(tl.sum(tl.where(flat == at, scores, 0.0), axis=1), axis=0)
            vals = tl.where(kk == j, score, vals)
            idxs = tl.where(kk == j, at, idxs)
            work = tl.where(flat == at, float("-inf"), work)
        if RENORM:
            vals = vals / (tl.sum(tl.where(kk < K, vals, 0.0), axis=0) + 1e-20)
        tl.store(ids_ptr + row * K + kk, idxs, mask=kk < K)
        tl.store(weights_ptr + row * K + kk, vals * scaling, mask=kk < K)


def _routes(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' outputs for logits [T, E]: ids [T, k] int32, weights [T, k] float32."""
    shape, device = (logits.shape[0], k), logits.device
    return (torch.empty(shape, dtype=torch.int32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))  # fmt: skip


def softmax_topk(logits: torch.Tensor, k: int, renorm: bool, scaling: float,
                 round_to_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] -> (ids [T, k] int32, weights [T, k] float32), best first."""
    tokens, num_experts = logits.shape
    ids, weights = _routes(logits, k)
    if tokens:
        _softmax_topk_kernel[(tokens,)](
            logits, ids, weights, logits.stride(0), num_experts, float(scaling), K=k,
            KP=triton.next_power_of_2(k), BLOCK=triton.next_power_of_2(num_experts),
            RENORM=renorm, ROUND=round_to_logits_dtype,
        )  # fmt: skip
    return ids, weights


def grouped_topk_fits(num_experts: int, num_groups: int) -> bool:
    """The kernel lays a row out as [groups, experts per group], both powers of two."""
    per_group = num_experts // num_groups
    return all(n > 0 and n & (n - 1) == 0 for n in (num_groups, per_group))


def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, num_groups: int,
                         topk_groups: int, renorm: bool,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] float32, bias [E] float32 -> (ids [T, k] int32, weights [T, k] float32)."""
    tokens, num_experts = logits.shape
    ids, weights = _routes(logits, k)
    if tokens:
        _grouped_sigmoid_topk_kernel[(tokens,)](
            logits, bias, ids, weights, logits.stride(0), float(scaling), G=num_groups,
            EG=num_experts // num_groups, TOPK_GROUPS=topk_groups, K=k,
            KP=triton.next_power_of_2(k), RENORM=renorm,
        )  # fmt: skip
    return ids, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows of unit stride, evenly spaced), weight [D] of x's dtype -> [..., D]."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if not x.is_contiguous() else x.view(-1, dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), dim, eps,
                                           BLOCK=triton.next_power_of_2(dim))  # fmt: skip
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """h, delta [T, D] of one dtype (rows of unit stride), weight [D] -> (h + delta, its
    rms_norm): a residual add and the norm after it, in one kernel."""
    dim = h.shape[-1]
    total = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if h.numel():
        _add_rms_norm_kernel[(h.shape[0],)](h, delta, weight, total, out, h.stride(0),
                                            delta.stride(0), dim, eps,
                                            BLOCK=triton.next_power_of_2(dim))  # fmt: skip
    return total, out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x [T, heads, dim] (any token/head strides), cos/sin [T, dim/2] float32 -> [T, heads, dim]."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if x.numel():
        _rotary_kernel[(tokens * heads,)](
            x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), heads, dim // 2,
            INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(dim // 2),
        )  # fmt: skip
    return out


def qk_rope_cache_fits(q, k, v, k_cache, v_cache, cos, sin, weights) -> bool:
    """Whether qk_rope_cache takes these: supports(...) for all, caches not FP8 (which the torch
    code writes as saturated bytes), norm weights (if any) of q's dtype, and k, v and cache
    rows of one head dim."""
    norm_ok = all(w is None or w.dtype == q.dtype for w in weights)
    return (norm_ok and supports(q, k, v, k_cache, v_cache, cos, sin)
            and k_cache.dtype != torch.float8_e4m3fn and v_cache.dtype != torch.float8_e4m3fn
            and q.shape[-1] == k.shape[-1] == v.shape[-1] == k_cache.shape[-1]
            == v_cache.shape[-1])  # fmt: skip


def qk_rope_cache(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots):
    """The attention's per-token steps before the paged attention, in one kernel: q [T, Hq, D]
    and k [T, Hkv, D] RMSNorm'd per head (q_weight / k_weight [D]; None: no norm) and rotated
    (halves, not interleaved) by cos/sin [T, D/2] float32; k and v [T, Hkv, D] written into
    k_cache / v_cache [S, Hkv, D] at slots [T]. Returns the rotated q [T, Hq, D] (q's dtype).
    The torch code it replaces (the oracle): RMSNorm, apply_rotary, kvcache.tensors.write_cache."""
    tokens, heads_q, dim = q.shape
    heads_kv = k.shape[1]
    out = torch.empty((tokens, heads_q, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    norm = q_weight is not None
    _qk_rope_cache_kernel[(tokens * (heads_q + heads_kv),)](
        q, k, v, q_weight if norm else q, k_weight if norm else k, cos.contiguous(),
        sin.contiguous(), slots, out, k_cache, v_cache, *q.stride()[:2], *k.stride()[:2],
        *v.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2], heads_q, heads_kv,
        dim // 2, float(eps), NORM=norm, BLOCK=triton.next_power_of_2(dim // 2),
    )  # fmt: skip
    return out


def mla_rope_cache_fits(q_rot, kv_a, weight, cache, cos, sin) -> bool:
    """Whether mla_rope_cache takes these: supports(...) for all, the cache [S, rank + rope] not
    FP8 (which the torch code writes as saturated bytes), the norm weight of kv_a's dtype."""
    rope = q_rot.shape[-1]
    return (supports(q_rot, kv_a, weight, cache, cos, sin) and cache.dim() == 2
            and cache.dtype != torch.float8_e4m3fn and weight.dtype == kv_a.dtype
            and kv_a.shape[-1] == cache.shape[-1] == weight.shape[0] + rope)  # fmt: skip


def mla_rope_cache(q_rot, kv_a, weight, eps, cos, sin, cache, slots, interleaved: bool):
    """MLA's per-token steps before the absorbed attention, in one kernel: q_rot [T, H, rope]
    (any token/head strides) rotated by cos/sin [T, rope/2] float32, and each token's kv_a
    [T, rank + rope] row (rows of unit stride) written into cache [S, rank + rope] at slots [T]
    as [RMSNorm(latent) by weight [rank] | its rotary part rotated]. Returns the rotated q_rot
    [T, H, rope] (q_rot's dtype). The torch code it replaces (the oracle): RMSNorm,
    apply_rotary twice, torch.cat and kvcache.tensors.write_cache."""
    tokens, heads, rope = q_rot.shape
    rank = weight.shape[0]
    out = torch.empty((tokens, heads, rope), dtype=q_rot.dtype, device=q_rot.device)
    if tokens == 0:
        return out
    _mla_rope_cache_kernel[(tokens * (heads + 1),)](
        q_rot, kv_a, weight, cos.contiguous(), sin.contiguous(), slots, out, cache,
        *q_rot.stride()[:2], kv_a.stride(0), cache.stride(0), heads, rank, rope // 2, float(eps),
        INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(rope // 2),
        BLOCK_R=triton.next_power_of_2(rank),
    )  # fmt: skip
    return out
