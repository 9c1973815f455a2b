"""A worker's packed expert store made and mapped for the streamed-prefill tests, and the numpy
oracle of its dequantization."""

from __future__ import annotations

import numpy as np
import torch

from expert_service import packed_store
from expert_service.expert_shard import ExpertShard
from expert_service.kernels import pack_experts
from expert_service.server import _store_pb
from gpu_service.experts.stream_prefill.store import MappedStore
from ktserve.checkpoint import ModelSpec
from ktserve.names import weight_format_to_pb
from ktserve.protocol import expert_pb2 as pb

H, I, E = 72, 40, 12  # noqa: E741


CONFIG = {"model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I,
          "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 2,
          "intermediate_size": 64, "num_attention_heads": 2, "vocab_size": 50}  # fmt: skip


def make_store(root, seed: int, fmt: str, experts: range) -> tuple[dict, pb.WorkerInfo]:
    """A converted store of 2 MoE layers of random experts; its packed layers, and the
    WorkerInfo a worker serving it reports."""
    spec = ModelSpec.from_config(CONFIG, source="test")
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for layer in spec.moe_layers:
        n = len(experts)
        gate, up = torch.randn(n, I, H, generator=g), torch.randn(n, I, H, generator=g)
        down = torch.randn(n, H, I, generator=g)
        layers[layer] = pack_experts(gate, up, down, fmt, num_threads=1)
    shard = ExpertShard(spec, "test", fmt, experts, layers)
    out = packed_store.save(shard, root, CONFIG)
    loaded = packed_store.load(out, experts, fmt)
    info = pb.WorkerInfo(format=weight_format_to_pb(fmt), pid=1)
    info.experts.start, info.experts.stop = experts.start, experts.stop
    info.store.CopyFrom(_store_pb(loaded.store))
    return layers, info


def open_store(info: pb.WorkerInfo) -> MappedStore:
    spec = ModelSpec.from_config(CONFIG, source="test")
    return MappedStore(info, H, I, spec.moe_layers)


def roundup64(n: int) -> int:
    return -(-n // 64) * 64


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def numpy_matrix(fmt: str, w: np.ndarray, s: np.ndarray | None, rows: int, k: int) -> np.ndarray:
    """One expert's packed matrix of `rows` padded output rows over padded K -> float32 [rows, k],
    from ktk.h's formulas: element (k, r) of block j."""
    r = np.arange(rows)[:, None]  # [rows, 1]
    kk = np.arange(k)[None, :]  # [1, k]
    j, rb = r // 16, r % 16
    if fmt == "bf16":
        at = j * (16 * k) + (kk // 2) * 32 + rb * 2 + kk % 2
        return bf16_to_f32(w[at])
    if fmt == "int8":
        at = j * (16 * k) + (kk // 4) * 64 + rb * 4 + kk % 4
        return w.view(np.int8)[at].astype(np.float32) * s[j * 16 + rb]
    g, quad = kk // 32, (kk % 32) // 4
    at = j * (8 * k) + g * 256 + (quad % 4) * 64 + rb * 4 + kk % 4
    byte = w[at].astype(np.int32)
    nibble = np.where(quad < 4, byte & 0x0F, byte >> 4)
    scale = bf16_to_f32(s[(j * (k // 32) + g) * 16 + rb])
    return (nibble - 8).astype(np.float32) * scale


def numpy_dequant(packed, hidden: int, inter: int):
    """gate, up [E, I, H], down [E, H, I] float32 from the packed buffers."""
    hp, ip = roundup64(hidden), roundup64(inter)
    t = packed.tensors
    gates, ups, downs = [], [], []
    for e in range(packed.num_experts):
        s13 = t["s13"][e] if "s13" in t else None
        s2 = t["s2"][e] if "s2" in t else None
        m13 = numpy_matrix(packed.fmt, t["w13"][e], s13, 2 * ip, hp)  # blocks gate, up, ...
        blocks = m13.reshape(ip // 16, 2, 16, hp)
        gates.append(blocks[:, 0].reshape(ip, hp)[:inter, :hidden])
        ups.append(blocks[:, 1].reshape(ip, hp)[:inter, :hidden])
        downs.append(numpy_matrix(packed.fmt, t["w2"][e], s2, hp, ip)[:hidden, :inter])
    return np.stack(gates), np.stack(ups), np.stack(downs)
