"""Checkpoint reading against transformers: tiny random checkpoints saved and loaded by transformers
are the oracle for every weight the reader returns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ktserve.checkpoint import (
    SUPPORTED_FAMILIES,
    CheckpointDirNotFound,
    CheckpointError,
    CheckpointReader,
    ConfigNotFound,
    InsufficientMemory,
    InvalidConfig,
    InvalidExpertRange,
    LayerHasNoExperts,
    MissingExpertTensor,
    ModelSpec,
    NotAnMoEModel,
    SafetensorsNotFound,
    ShardOutOfRange,
    TensorShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedTensorDtype,
    available_memory_bytes,
    check_memory_available,
    estimate_shard_bytes,
    parse_expert_range,
    validate_shard,
)
from tests.support.checkpoints import (
    FP8_OVERRIDES,
    available_families,
    dequantize_fp8_reference,
    load_reference_model,
    make_tiny_checkpoint,
    moe_block,
    moe_layer_indices,
    reference_expert_weights,
    tiny_config,
)
from tests.support.reference_moe import reference_moe

FAMILIES = available_families()
GIB = 2**30


def _rewrite_tensors(model_dir: Path, edit) -> None:
    """Apply edit(tensors: dict) to every safetensors file of a single-file checkpoint."""
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(model_dir: Path, **changes) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _raw_tensor(model_dir: Path, name: str) -> torch.Tensor:
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return handle.get_tensor(name)
    raise KeyError(name)


# --- weights equal transformers' own, every family and both layouts ---------------------------


@pytest.mark.parametrize("per_expert_names", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reader_matches_transformers_bitwise(
    family: str, per_expert_names: bool, seed: int, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(family, tmp_path, seed=seed, per_expert_names=per_expert_names)
    model = load_reference_model(path)
    config = model.config
    with CheckpointReader(path) as reader:
        spec = reader.spec
        assert spec.family == family == config.model_type
        assert spec.moe_layers == moe_layer_indices(model)
        assert spec.num_layers == config.num_hidden_layers
        assert spec.hidden_size == config.hidden_size
        assert spec.num_experts_per_tok == config.num_experts_per_tok
        for layer in spec.moe_layers:
            assert reader.expert_layout(layer) == ("per_expert" if per_expert_names else "fused")
            for expert in range(spec.num_experts):
                got = reader.read_expert(layer, expert)
                want = reference_expert_weights(model, layer, expert)
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == torch.float32
                    assert torch.equal(g, w), (layer, expert)
        gate, up, down = want
        assert gate.shape == (spec.moe_intermediate_size, spec.hidden_size) == up.shape
        assert down.shape == (spec.hidden_size, spec.moe_intermediate_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_read_experts_stacks_in_order_and_reports_progress(
    family: str, seed: int, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(family, tmp_path, seed=seed)
    reader = CheckpointReader(path)
    layer = reader.spec.moe_layers[-1]
    ids = [3, 0, reader.spec.num_experts - 1, 1]
    calls: list[tuple[int, int]] = []
    gates, ups, downs = reader.read_experts(
        layer, ids, dtype=torch.bfloat16, progress=lambda d, t: calls.append((d, t))
    )
    assert calls == [(i + 1, len(ids)) for i in range(len(ids))]
    num, inter, hidden = len(ids), reader.spec.moe_intermediate_size, reader.spec.hidden_size
    assert gates.shape == ups.shape == (num, inter, hidden) and downs.shape == (num, hidden, inter)
    assert gates.dtype == ups.dtype == downs.dtype == torch.bfloat16
    for i, expert in enumerate(ids):
        names = reader.spec.expert_tensor_names(layer, expert)
        for stacked, name in zip((gates, ups, downs), names, strict=True):
            assert torch.equal(stacked[i], _raw_tensor(path, name))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fp16_and_fp32_checkpoints(
    family: str, dtype: torch.dtype, seed: int, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(family, tmp_path, seed=seed, dtype=dtype)
    model = load_reference_model(path)
    reader = CheckpointReader(path)
    layer = reader.spec.moe_layers[0]
    gate_name = reader.spec.expert_tensor_names(layer, 2)[0]
    assert _raw_tensor(path, gate_name).dtype == dtype
    want = reference_expert_weights(model, layer, 2)
    for got, w in zip(reader.read_expert(layer, 2), want, strict=True):
        assert torch.equal(got, w)
    assert torch.equal(reader.read_expert(layer, 2, dtype=dtype)[0], _raw_tensor(path, gate_name))


def test_sharded_checkpoint_uses_index(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    assert len(files) > 2
    reader = CheckpointReader(path)
    model = load_reference_model(path)
    layer = reader.spec.moe_layers[-1]
    expert = reader.spec.num_experts - 1
    files_used = {index["weight_map"][n] for n in reader.spec.expert_tensor_names(layer, expert)}
    print(f"{len(files)} shards; expert {expert} of layer {layer} lies in {sorted(files_used)}")
    want = reference_expert_weights(model, layer, expert)
    for got, w in zip(reader.read_expert(layer, expert), want, strict=True):
        assert torch.equal(got, w)
    missing = files[-1]
    missing.unlink()
    with pytest.raises(SafetensorsNotFound) as err:
        CheckpointReader(path)
    assert missing.name in str(err.value) and "model.safetensors.index.json" in str(err.value)


# --- FP8 (DeepSeek-V3 block scales) ------------------------------------------------------------


@pytest.mark.parametrize("per_expert_names", [True, False], ids=["per_expert", "fused"])
def test_fp8_dequant_matches_block_oracle_and_original(
    per_expert_names: bool, seed: int, tmp_path: Path
) -> None:
    original_path = make_tiny_checkpoint(
        "deepseek_v3",
        tmp_path / "bf16",
        seed=seed,
        per_expert_names=per_expert_names,
        **FP8_OVERRIDES,
    )
    fp8_path = make_tiny_checkpoint(
        "deepseek_v3", tmp_path / "fp8", seed=seed, per_expert_names=per_expert_names, fp8=True
    )
    original = CheckpointReader(original_path)
    reader = CheckpointReader(fp8_path)
    spec = reader.spec
    assert spec.weight_block_size == (128, 128)
    # NOTE: 192 x 200 weights leave partial blocks at the bottom and right edges.
    assert spec.moe_intermediate_size % 128 and spec.hidden_size % 128
    reference = load_reference_model(fp8_path)
    layer, experts = spec.moe_layers[-1], (0, spec.num_experts - 1)
    for expert in experts:
        got = reader.read_expert(layer, expert)
        if per_expert_names:
            names = spec.expert_tensor_names(layer, expert)
            oracle = [
                dequantize_fp8_reference(
                    _raw_tensor(fp8_path, n), _raw_tensor(fp8_path, f"{n}_scale_inv")
                )
                for n in names
            ]
            assert _raw_tensor(fp8_path, names[0]).dtype == torch.float8_e4m3fn
        else:
            gate_up_name, down_name = spec.fused_tensor_names(layer)
            gate_up, down = (
                dequantize_fp8_reference(
                    _raw_tensor(fp8_path, n)[expert],
                    _raw_tensor(fp8_path, f"{n}_scale_inv")[expert],
                )
                for n in (gate_up_name, down_name)
            )
            oracle = [*gate_up.chunk(2, dim=0), down]
        for g, o, w, ref in zip(
            got,
            oracle,
            original.read_expert(layer, expert),
            reference_expert_weights(reference, layer, expert),
            strict=True,
        ):
            assert torch.equal(g, o)
            assert torch.equal(g, ref)
            # e4m3: 3 mantissa bits -> relative error <= 2^-4, plus the subnormal step 2^-9 x scale.
            scale = w.abs().amax() / 448
            assert torch.all((g - w).abs() <= w.abs() * 2**-4 + scale * 2**-9)
            assert not torch.equal(g, w)


def test_fp8_fused_with_separately_blocked_gate_and_up(seed: int, tmp_path: Path) -> None:
    """A fused gate_up whose scales are gate's and up's own block scales stacked (2*ceil(I/128))."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, fp8=True)
    per_expert = CheckpointReader(path)
    spec = per_expert.spec
    want = {
        (layer, e): per_expert.read_expert(layer, e)
        for layer in spec.moe_layers
        for e in range(spec.num_experts)
    }

    def fuse(tensors: dict) -> None:
        for layer in spec.moe_layers:
            names = [spec.expert_tensor_names(layer, e) for e in range(spec.num_experts)]
            gate_up_name, down_name = spec.fused_tensor_names(layer)
            for suffix in ("", "_scale_inv"):
                tensors[gate_up_name + suffix] = torch.stack(
                    [torch.cat([tensors[g + suffix], tensors[u + suffix]]) for g, u, _ in names]
                )
                tensors[down_name + suffix] = torch.stack([tensors[d + suffix] for *_, d in names])
                for triple in names:
                    for name in triple:
                        del tensors[name + suffix]

    _rewrite_tensors(path, fuse)
    reader = CheckpointReader(path)
    layer = spec.moe_layers[0]
    gate_up_scale = _raw_tensor(path, spec.fused_tensor_names(layer)[0] + "_scale_inv")
    assert gate_up_scale.shape == (spec.num_experts, 4, 2)  # not ceil(384 / 128) = 3 rows
    assert reader.expert_layout(layer) == "fused"
    for (layer, expert), weights in want.items():
        for got, w in zip(reader.read_expert(layer, expert), weights, strict=True):
            assert torch.equal(got, w)


def test_fp8_block_size_comes_from_config(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, fp8=True, fp8_block=(64, 48))
    reader = CheckpointReader(path)
    assert reader.spec.weight_block_size == (64, 48)
    layer = reader.spec.moe_layers[0]
    name = reader.spec.expert_tensor_names(layer, 1)[2]
    scale = _raw_tensor(path, f"{name}_scale_inv")
    assert scale.shape == (4, 4)  # down [200, 192] in 64 x 48 blocks
    want = dequantize_fp8_reference(_raw_tensor(path, name), scale, (64, 48))
    assert torch.equal(reader.read_expert(layer, 1)[2], want)


def test_fp8_missing_or_misshapen_scale(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, fp8=True)
    spec = CheckpointReader(path).spec
    layer = spec.moe_layers[0]
    up_name = spec.expert_tensor_names(layer, 5)[1]
    down_name = spec.expert_tensor_names(layer, 6)[2]

    def edit(tensors: dict) -> None:
        del tensors[f"{up_name}_scale_inv"]
        tensors[f"{down_name}_scale_inv"] = tensors[f"{down_name}_scale_inv"][:, :1].contiguous()

    _rewrite_tensors(path, edit)
    reader = CheckpointReader(path)
    with pytest.raises(MissingExpertTensor, match=re.escape(f"{up_name}_scale_inv")):
        reader.read_expert(layer, 5)
    with pytest.raises(TensorShapeMismatch) as err:
        reader.read_expert(layer, 6)
    message = str(err.value)
    assert f"{down_name}_scale_inv" in message and "[2, 1]" in message and "[2, 2]" in message


# --- errors a user meets -----------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointDirNotFound) as err:
        CheckpointReader(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value) and "does not exist" in str(err.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointDirNotFound, match="is not a directory"):
        CheckpointReader(tmp_path / "file")


def test_no_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigNotFound) as err:
        CheckpointReader(tmp_path)
    assert "config.json" in str(err.value) and str(tmp_path) in str(err.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidConfig, match="JSON"):
        CheckpointReader(tmp_path)


def test_no_safetensors(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("mixtral", tmp_path, seed=seed)
    for file in path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(SafetensorsNotFound) as err:
        CheckpointReader(path)
    assert "*.safetensors" in str(err.value) and str(path) in str(err.value)


def test_not_an_moe_model(tmp_path: Path) -> None:
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(NotAnMoEModel) as err:
        CheckpointReader(tmp_path)
    assert "'llama'" in str(err.value) and "num_experts" in str(err.value)
    dense_v2 = {**tiny_config("deepseek_v2").to_dict(), "n_routed_experts": None}
    with pytest.raises(NotAnMoEModel, match="0 routed experts"):
        ModelSpec.from_config(dense_v2)
    all_dense = tiny_config("qwen3_moe", mlp_only_layers=[0, 1, 2, 3]).to_dict()
    with pytest.raises(NotAnMoEModel, match="none of its layers"):
        ModelSpec.from_config(all_dense)


def test_unknown_architecture(tmp_path: Path) -> None:
    config = {"model_type": "olmoe", "num_experts": 64, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture) as err:
        CheckpointReader(tmp_path)
    message = str(err.value)
    assert "'olmoe'" in message and all(family in message for family in SUPPORTED_FAMILIES)


@pytest.mark.parametrize("per_expert_names", [True, False], ids=["per_expert", "fused"])
def test_shape_mismatch(per_expert_names: bool, seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, seed=seed, per_expert_names=per_expert_names)
    _edit_config(path, moe_intermediate_size=25)  # the weights have 24
    reader = CheckpointReader(path)
    layer = reader.spec.moe_layers[0]
    with pytest.raises(TensorShapeMismatch) as err:
        reader.read_expert(layer, 0)
    if per_expert_names:
        name, expected, found = reader.spec.expert_tensor_names(layer, 0)[0], "[25, 56]", "[24, 56]"
    else:
        name, expected, found = (
            reader.spec.fused_tensor_names(layer)[0],
            "[10, 50, 56]",
            "[10, 48, 56]",
        )
    message = str(err.value)
    assert name in message and expected in message and found in message and str(path) in message


def test_missing_expert_tensor(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("mixtral", tmp_path, seed=seed)
    spec = CheckpointReader(path).spec
    up_name = spec.expert_tensor_names(1, 4)[1]
    layer0 = [n for e in range(spec.num_experts) for n in spec.expert_tensor_names(0, e)]

    def edit(tensors: dict) -> None:
        del tensors[up_name]
        for name in layer0:
            del tensors[name]

    _rewrite_tensors(path, edit)
    reader = CheckpointReader(path)
    reader.read_expert(1, 3)
    with pytest.raises(MissingExpertTensor) as err:
        reader.read_expert(1, 4)
    assert up_name in str(err.value) and str(path) in str(err.value)
    with pytest.raises(MissingExpertTensor) as err:
        reader.read_expert(0, 0)
    assert spec.expert_tensor_names(0, 0)[0] in str(err.value)
    assert spec.fused_tensor_names(0)[0] in str(err.value)


def test_unsupported_tensor_dtype(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("mixtral", tmp_path, seed=seed)
    name = CheckpointReader(path).spec.expert_tensor_names(0, 0)[2]
    _rewrite_tensors(path, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(UnsupportedTensorDtype) as err:
        CheckpointReader(path).read_expert(0, 0)
    assert name in str(err.value) and "I8" in str(err.value) and "BF16" in str(err.value)


def test_expert_and_layer_outside_the_model(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed)
    reader = CheckpointReader(path)
    with pytest.raises(ShardOutOfRange, match=re.escape("expert 12 is outside [0, 12)")):
        reader.read_expert(1, 12)
    with pytest.raises(ShardOutOfRange):
        reader.read_experts(1, [0, -1])
    with pytest.raises(LayerHasNoExperts, match="layer 0 has no routed experts.*1, 2"):
        reader.read_expert(0, 0)


def test_parse_and_validate_expert_range() -> None:
    assert parse_expert_range("0-63") == range(0, 64)
    assert parse_expert_range(" 5 ") == range(5, 6)
    assert parse_expert_range("8-8") == range(8, 9)
    for bad in ("", "a-b", "-1", "3-", "1-2-3", "7-3", "1.5"):
        with pytest.raises(InvalidExpertRange, match=re.escape(repr(bad))):
            parse_expert_range(bad)
    spec = ModelSpec.from_config(tiny_config("deepseek_v3").to_dict())
    validate_shard(spec, range(0, 12))
    validate_shard(spec, parse_expert_range("4-7"))
    with pytest.raises(ShardOutOfRange) as err:
        validate_shard(spec, parse_expert_range("8-12"))
    assert "8-12" in str(err.value) and "[0, 12)" in str(err.value)
    with pytest.raises(ShardOutOfRange):
        validate_shard(spec, range(-1, 3))
    with pytest.raises(ShardOutOfRange, match="empty"):
        validate_shard(spec, range(3, 3))


def test_model_spec_is_checked_and_frozen() -> None:
    spec = ModelSpec.from_config(tiny_config("mixtral").to_dict())
    assert spec.expert_tensor_names(1, 7) == (
        "model.layers.1.block_sparse_moe.experts.7.w1.weight",
        "model.layers.1.block_sparse_moe.experts.7.w3.weight",
        "model.layers.1.block_sparse_moe.experts.7.w2.weight",
    )
    qwen = ModelSpec.from_config({**tiny_config("qwen2_moe").to_dict(), "num_experts": 9})
    assert qwen.moe_layers == (1, 3)
    assert qwen.expert_tensor_names(3, 0)[2] == "model.layers.3.mlp.experts.0.down_proj.weight"
    with pytest.raises(AttributeError):
        spec.num_experts = 3  # type: ignore[misc]
    with pytest.raises(
        InvalidConfig, match=r"config <mine> .*num_experts_per_tok=9 is not in \[1, 8\]"
    ):
        ModelSpec.from_config(
            {**tiny_config("mixtral").to_dict(), "num_experts_per_tok": 9}, source="<mine>"
        )
    with pytest.raises(InvalidConfig, match="hidden_size"):
        ModelSpec.from_config({**tiny_config("mixtral").to_dict(), "hidden_size": "64"})
    with pytest.raises(InvalidConfig, match="weight_block_size"):
        ModelSpec.from_config(
            {
                **tiny_config("deepseek_v3").to_dict(),
                "quantization_config": {"weight_block_size": [128]},
            }
        )
    assert issubclass(CheckpointError, ValueError)
    for cls in (CheckpointDirNotFound, NotAnMoEModel, ShardOutOfRange, InsufficientMemory):
        assert issubclass(cls, CheckpointError)


# --- memory ------------------------------------------------------------------------------------


def test_estimate_shard_bytes_matches_what_is_read(seed: int, tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, seed=seed)
    reader = CheckpointReader(path)
    shard = parse_expert_range("2-6")
    read = sum(
        t.nbytes
        for layer in reader.spec.moe_layers
        for t in reader.read_experts(layer, shard, dtype=torch.bfloat16)
    )
    assert estimate_shard_bytes(reader.spec, len(shard), 2) == read
    assert estimate_shard_bytes(reader.spec, len(shard), 0.5) == read // 4  # int4


def test_memory_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KTSERVE_MEMORY_LIMIT_BYTES", raising=False)
    available, source = available_memory_bytes()
    assert available > 0 and "MemAvailable" in source
    assert check_memory_available(1) > 0
    with pytest.raises(InsufficientMemory, match="MemAvailable"):
        check_memory_available(2**60)

    monkeypatch.setenv("KTSERVE_MEMORY_LIMIT_BYTES", str(3 * GIB))
    assert check_memory_available(3 * GIB) == 3 * GIB
    with pytest.raises(InsufficientMemory) as err:
        check_memory_available(5 * GIB + GIB // 2)
    message = str(err.value)
    assert (
        "5.50 GiB" in message and "3.00 GiB" in message and "KTSERVE_MEMORY_LIMIT_BYTES" in message
    )
    assert err.value.required_bytes == 5 * GIB + GIB // 2 and err.value.available_bytes == 3 * GIB


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_reproduce_transformers_experts_forward(
    family: str, seed: int, tmp_path: Path
) -> None:
    """gate/up/down as read compute what transformers' own experts module computes (DESIGN's MoE
    call contract), so their order and orientation are right, not only their values."""
    path = make_tiny_checkpoint(family, tmp_path, seed=seed)
    model = load_reference_model(path)
    reader = CheckpointReader(path)
    spec = reader.spec
    generator = torch.Generator().manual_seed(seed)
    num_tokens, top_k = 7, spec.num_experts_per_tok
    x = torch.randn(num_tokens, spec.hidden_size, generator=generator)  # [T, H]
    ids = torch.stack([torch.randperm(spec.num_experts, generator=generator)[:top_k] for _ in x])
    weights = torch.rand(num_tokens, top_k, generator=generator)  # [T, k]
    for layer in spec.moe_layers:
        with torch.no_grad():
            want = moe_block(model, layer).experts(x, ids, weights)  # [T, H]
        gates, ups, downs = reader.read_experts(layer, range(spec.num_experts))
        got = reference_moe(x, ids, weights, gates, ups, downs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("per_expert_names", [True, False], ids=["per_expert", "fused"])
def test_shard_packs_what_the_float32_experts_pack(
    fp8: bool, per_expert_names: bool, seed: int, tmp_path: Path
) -> None:
    """load_shard packs the tensors as stored (FP8 dequantized while packing) where the layout
    allows: the shard is bit for bit what packing the reader's float32 experts gives."""
    from expert_service.kernels import pack_experts
    from expert_service.shard import load_shard

    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, fp8=fp8,
                                per_expert_names=per_expert_names)  # fmt: skip
    experts = range(1, 6)
    shard = load_shard(path, experts, "int4")
    reader = CheckpointReader(path)
    stored = reader.stored_experts(reader.spec.moe_layers[0], list(experts))
    assert (stored is not None) == per_expert_names
    for layer in reader.spec.moe_layers:
        want = pack_experts(*reader.read_experts(layer, list(experts)), "int4")
        for name, tensor in want.tensors.items():
            assert (shard.layers[layer].tensors[name] == tensor).all(), (layer, name)
