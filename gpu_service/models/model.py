"""The decoder skeleton every family shares, and the step the engine calls.

    h = embed(tokens)                                      # [T, H]
    for each layer: h = h + attn(norm_1(h)); h = h + mlp(norm_2(h))   (mlp: dense or MoE)
                    (with expert deferral an MoE layer's mlp output also holds the previous MoE
                    layer's deferred experts: moe.py)
    logits = lm_head(norm(h))                              # [B, V] (last tokens) or [T, V]

Families (deepseek.py, qwen_moe.py, mixtral.py, glm4_moe.py) build the attention and MLP
modules per layer, each given the AttentionBackend chosen at load (its kernels), and hand them
to `CausalLM` with the KV cache's tensors they need (which blocks a sequence holds is the
business of the KV manager, kvcache/manager.py, which the engine's scheduler owns). The step is
written as methods that split it at each MoE layer's expert call (embed_tokens,
attend_then_norm, the MoE's route / shared_out / combine, logits): the engine's decode graphs
run the same methods segment by segment. Usage:

    kv = KVCacheManager(model.kv_cache.config)
    cache = kv.allocate(len(prompt))
    logits = model.forward(Batch((SeqInput(prompt, cache, 0),)))        # prefill, [1, V]
    kv.extend(cache, len(prompt) + 1)
    logits = model.forward(Batch((SeqInput([tok], cache, len(prompt)),)))  # decode
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import AttentionMetadata, Batch, StepContext
from gpu_service.experts.routed import abandon
from gpu_service.kvcache.tensors import KVCacheTensors
from gpu_service.layers.blocks import Linear, RMSNorm
from gpu_service.layers.linear import make_linear
from gpu_service.layers.loader import WeightLoader
from gpu_service.layers.moe import MoE
from gpu_service.layers.rope import Rotary
from gpu_service.models.config import BaseConfig


class StepListener(Protocol):
    def on_step(self, batch: Batch, all_positions: bool) -> None: ...

    def on_step_failed(self, exc: BaseException) -> None: ...


class DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.input_norm, self.post_norm = attn, mlp, input_norm, post_norm

    @classmethod
    def load(cls, loader: WeightLoader, layer: int, attn: nn.Module, mlp: nn.Module,
             hidden: int, eps: float, backend: AttentionBackend) -> DecoderLayer:  # fmt: skip
        """The layer with its two norms read from the checkpoint (names every family shares)."""
        p = f"model.layers.{layer}"
        fused = backend.fused_kernels
        return cls(
            attn,
            mlp,
            RMSNorm.load(loader, f"{p}.input_layernorm", hidden, eps, fused_kernels=fused),
            RMSNorm.load(
                loader, f"{p}.post_attention_layernorm", hidden, eps, fused_kernels=fused
            ),  # fmt: skip
        )

    def attend_then_norm(
        self, h: torch.Tensor, ctx: StepContext, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual [T, H] after the layer's attention, the post-attention norm of it: what
        the MLP runs on) with `pending` (the layer before's MLP output, not added yet) added to
        h first: each residual add is one step with the norm after it."""
        if pending is None:
            attn_in = self.input_norm(h)
        else:
            h, attn_in = self.input_norm.add_then_norm(h, pending)
        return self.post_norm.add_then_norm(h, self.attn(attn_in, ctx))

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h, x = self.attend_then_norm(h, ctx)
        return h + self.mlp(x)


class CausalLM(nn.Module):
    def __init__(
        self,
        config: BaseConfig,
        loader: WeightLoader,
        layers: list[DecoderLayer],
        rotary: Rotary,
        kv_cache: KVCacheTensors,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.config = config
        self.device, self.dtype = loader.device, loader.dtype
        vocab, hidden = config.vocab_size, config.hidden_size
        self.register_buffer("embed", loader.get("model.embed_tokens.weight", (vocab, hidden)))
        self.layers = nn.ModuleList(layers)
        self.backend = backend  # its layers' kernels, chosen at load
        self.norm = RMSNorm.load(loader, "model.norm", hidden, config.rms_norm_eps,
                                 fused_kernels=backend.fused_kernels)  # fmt: skip
        quant = loader.linear_quant
        if config.tie_word_embeddings and not loader.has("lm_head.weight"):
            fmt = quant.format if quant.quantize_lm_head else "bf16"
            self.lm_head = make_linear(self.embed, None, fmt, self.dtype)
        else:
            self.lm_head = Linear.load(loader, "lm_head", hidden, vocab,
                                       quantize=quant.quantize_lm_head)  # fmt: skip
        self.rotary = rotary
        self.kv_cache = kv_cache
        # told of each checked forward before it runs, and of its failure: a tensor-parallel
        # rank 0 hands the step to its followers (gpu_service/tensor_parallel/leader.py)
        self.step_listener: StepListener | None = None
        # the last run streamed its prefill rows' experts through the GPU (stream_prefill): its
        # time follows the copies', not what a step through the workers costs
        self.last_step_streamed = False

    @property
    def moes(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def _step_aware_experts(self) -> list:
        """The MoE layers' expert backends that plan each step (begin_step / end_step: the
        rows a step streams through the GPU, stream_prefill), each once."""
        found = {id(m.experts): m.experts for m in self.moes if hasattr(m.experts, "begin_step")}
        return list(found.values())

    @property
    def stream_threshold(self) -> int | None:
        """The fewest prefill rows a step streams through the GPU (stream_prefill); None: no
        step streams."""
        found = [b.min_tokens for b in self._step_aware_experts() if b.min_tokens is not None]
        return min(found, default=None)

    @property
    def num_deferred_experts(self) -> int:
        """Routed experts per token each MoE layer but the last defers to the next (moe.py)."""
        return max((moe.num_deferred for moe in self.moes), default=0)

    def defer_experts(self, num: int) -> None:
        """Defer each token's `num` lowest-weight routed experts of every MoE layer but the
        last to the next MoE layer (0: none); num must be below the experts per token."""
        moes = self.moes
        top_k = moes[0].router.top_k if moes else 0
        if num < 0 or (num and num >= top_k):
            raise ValueError(
                f"max_deferred_experts_per_token must be >= 0 and below the model's {top_k} "
                f"routed experts per token (num_experts_per_tok), got {num}"
            )
        for i, moe in enumerate(moes):
            moe.num_deferred = num if i < len(moes) - 1 else 0

    def check_batch(self, batch: Batch) -> None:
        """Raises ValueError (or InvalidSequenceCache) for a batch this model cannot run: caches
        freed or too small, ids outside the embedding table (on CUDA, indexing past it is a
        device-side assert that breaks the context for everyone). These are invariants of the
        batches the runner builds; requests are checked where they enter the engine
        (engine/validation.py)."""
        for s in batch.seqs:
            s.cache.check_not_freed()
            if s.end_pos > s.cache.capacity:
                raise ValueError(
                    f"sequence {s.cache.seq_id}: positions up to {s.end_pos} do not fit its cache "
                    f"capacity {s.cache.capacity}; call KVCacheManager.extend(cache, "
                    f"{s.end_pos}) first"
                )
            if max(s.token_ids) >= self.config.vocab_size or min(s.token_ids) < 0:
                raise ValueError(
                    f"sequence {s.cache.seq_id}: token ids must be in [0, {self.config.vocab_size})"
                )

    def context(self, meta: AttentionMetadata) -> StepContext:
        """What every layer of a step shares: the metadata, its rotary angles and the cache."""
        cos, sin = self.rotary(meta.positions)  # [T, rope_dim/2]
        return StepContext(meta=meta, cos=cos, sin=sin, kv_cache=self.kv_cache)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens]  # [T, H]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, V] of hidden states h [N, H] after the last layer."""
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def forward(self, batch: Batch, all_positions: bool = False) -> torch.Tensor:
        """float32 logits: [B, V] at each sequence's last new token, or [T, V] for every new token
        (flat, sequence after sequence; batch.cu_seqlens splits them) with all_positions=True."""
        self.check_batch(batch)
        listener = self.step_listener
        if listener is None:
            return self.run(batch, all_positions)
        listener.on_step(batch, all_positions)
        try:
            return self.run(batch, all_positions)
        except BaseException as exc:
            listener.on_step_failed(exc)
            raise

    @torch.inference_mode()
    def run(self, batch: Batch, all_positions: bool = False,
            logits: bool = True) -> torch.Tensor | None:  # fmt: skip
        """forward without its checks (a tensor-parallel follower runs what rank 0 checked);
        logits=False stops after the last layer (None)."""
        meta = AttentionMetadata.build(batch, self.device)
        ctx = self.context(meta)
        tokens = torch.tensor(
            [t for s in batch.seqs for t in s.token_ids], dtype=torch.int64, device=self.device
        )
        h = self.embed_tokens(tokens)  # [T, H]
        deferred = None  # the last MoE layer's deferred call, joined at the next one's combine
        step_aware = self._step_aware_experts()
        seq_lens = [len(s.token_ids) for s in batch.seqs]
        # NOTE: a list, not any(): every backend plans the step
        self.last_step_streamed = any([backend.begin_step(seq_lens) for backend in step_aware])
        pending = None  # the last layer's MLP output: added to h in the next layer's first norm
        try:
            for layer in self.layers:
                h, x = layer.attend_then_norm(h, ctx, pending)
                if isinstance(layer.mlp, MoE):
                    pending, deferred = layer.mlp.step(x, deferred)
                else:
                    pending = layer.mlp(x)
        except BaseException:
            abandon(deferred)
            raise
        finally:
            for backend in step_aware:
                backend.end_step()
        for s in batch.seqs:
            s.cache.num_tokens = s.end_pos
        if not logits:
            return None
        if not all_positions:
            h = h[meta.last_index]  # [B, H]
            pending = None if pending is None else pending[meta.last_index]
        return self.logits(h if pending is None else h + pending)
