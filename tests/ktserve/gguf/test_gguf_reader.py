"""ktserve.gguf against GGUF files written as llama.cpp's converter writes them (gguf's own writer,
name map and quantizers; tests/support/gguf_checkpoints.py): the config from the metadata, every
tensor under its Hugging Face name equal to what the gguf package dequantizes, and each refusal
with its message, before anything loads."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktserve.checkpoint import CheckpointReader, HFConfig, ModelSpec
from ktserve.gguf.container import open_checkpoint
from ktserve.gguf.errors import GGUFError
from ktserve.gguf.tensors import GGUFTensors
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.gguf_checkpoints import GGUF_OVERRIDES, mixed_types, write_gguf

FAMILIES = tuple(GGUF_OVERRIDES)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, seed: int) -> dict[str, tuple[Path, Path, dict]]:
    """{family: (its HF checkpoint, its mixed-type GGUF, the reference weights)}."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for i, family in enumerate(FAMILIES):
        checkpoint = make_tiny_checkpoint(family, root / family, seed=seed + i,
                                          **GGUF_OVERRIDES[family])  # fmt: skip
        first, reference = write_gguf(checkpoint, root / f"{family}.gguf", mixed_types, seed=seed)
        made[family] = (checkpoint, first, reference)
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_metadata_matches_config_json(family, ggufs):
    checkpoint, first, _ = ggufs[family]
    want = HFConfig.from_checkpoint(checkpoint)
    got = HFConfig.from_checkpoint(first)
    assert got.model_type == want.model_type
    assert ModelSpec.from_hf(got) == ModelSpec.from_hf(want)
    keys = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "num_experts_per_tok",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "n_shared_experts",
        "first_k_dense_replace",
        "head_dim",
        "num_key_value_heads",
        "tie_word_embeddings",
    ]
    for key in keys:
        if want.data.get(key) is not None and key in got.data:
            assert got.data[key] == want.data[key], key
    theta = want.dict("rope_parameters").get("rope_theta", want.data.get("rope_theta"))
    assert got.float("rope_theta") == theta


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_reads_as_the_package_dequantizes_it(family, ggufs):
    """Each Hugging Face name the checkpoint has reads back (permutations and splits undone)
    exactly as the gguf package dequantizes the bytes written for it; K-quants included."""
    checkpoint, first, reference = ggufs[family]
    tensors = GGUFTensors(first)
    assert sorted(tensors.names()) == sorted(reference)
    types = {tensors.checkpoint.tensor_type(n).name for n in tensors.checkpoint.tensors}
    print(f"{family}: types {sorted(types)}")
    assert {"Q4_K", "Q6_K", "F32"} <= types and types & {"Q8_0", "BF16", "F16"}
    for name, want in reference.items():
        got = tensors.read(name)
        assert got.dtype == torch.float32 and torch.equal(got, want), name


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_reader_gives_the_dequantized_experts(family, ggufs):
    _, first, reference = ggufs[family]
    with CheckpointReader(first) as reader:
        spec = reader.spec
        layer, expert = spec.moe_layers[-1], spec.num_experts - 1
        names = spec.expert_tensor_names(layer, expert)
        got = reader.read_expert(layer, expert)
        for name, tensor in zip(names, got):
            assert torch.equal(tensor, reference[name])


@pytest.mark.parametrize("family, overrides", [
    ("mixtral", {}),
    ("qwen2_moe", {"decoder_sparse_step": 1}),  # NOTE: llama.cpp's qwen2moe has no dense layer
    ("deepseek_v2", {}),
])  # fmt: skip
def test_unchanged_bf16_weights_read_back_exactly(family, overrides, tmp_path, seed):
    """A GGUF of the checkpoint's own bf16 weights (llama.cpp's --outtype bf16) holds them
    exactly: every tensor equals the safetensors one (Mixtral's q/k permutation undone, Qwen2's
    shared_expert_gate a row again, DeepSeek-V2's kv_b joined), the config its config.json's."""
    checkpoint = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=seed, **overrides)
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf")
    from safetensors.torch import load_file

    original = {}
    for file in checkpoint.glob("*.safetensors"):
        original.update(load_file(file))
    tensors = GGUFTensors(first)
    assert sorted(tensors.names()) == sorted(original)
    for name, want in original.items():
        assert torch.equal(tensors.read(name), want.float()), name
    got, config = HFConfig.from_checkpoint(first), HFConfig.from_checkpoint(checkpoint)
    assert got.model_type == config.model_type
    assert ModelSpec.from_hf(got) == ModelSpec.from_hf(config)


def test_split_set_and_directory_read_as_one_file(tmp_path, seed):
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed,
                                      **GGUF_OVERRIDES["qwen3_moe"])  # fmt: skip
    (tmp_path / "split").mkdir()
    first, reference = write_gguf(checkpoint, tmp_path / "split" / "m.gguf", seed=seed,
                                  split_max_tensors=7)  # fmt: skip
    files = sorted((tmp_path / "split").glob("*.gguf"))
    assert len(files) > 2 and first.name == f"m-00001-of-{len(files):05d}.gguf"
    for path in (first, files[-1], tmp_path / "split"):
        tensors = GGUFTensors(path)
        assert sorted(tensors.names()) == sorted(reference)
        name = "model.layers.3.mlp.experts.9.down_proj.weight"
        assert torch.equal(tensors.read(name), reference[name])


# -- refusals --------------------------------------------------------------------------------


@pytest.fixture
def small_gguf(tmp_path, seed) -> Path:
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    return write_gguf(checkpoint, tmp_path / "model.gguf")[0]


def _refused(path: Path, *phrases: str) -> str:
    with pytest.raises(GGUFError) as info:
        HFConfig.from_checkpoint(path)
        GGUFTensors(path)
    message = str(info.value)
    print(message)
    for phrase in phrases:
        assert phrase in message
    return message


def test_refuses_a_truncated_file(small_gguf):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data[: len(data) - 1000])
    _refused(small_gguf, "truncated", "ends at byte", str(small_gguf))


def test_refuses_a_file_cut_inside_its_metadata(small_gguf):
    small_gguf.write_bytes(small_gguf.read_bytes()[:200])
    _refused(small_gguf, "truncated or corrupt metadata")


def test_refuses_bad_magic(small_gguf):
    data = bytearray(small_gguf.read_bytes())
    data[:4] = b"GGML"
    small_gguf.write_bytes(bytes(data))
    _refused(small_gguf, "b'GGML'", "not the GGUF magic")


def test_refuses_a_big_endian_file(tmp_path):
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _refused(path, "big-endian", "little-endian")


def test_refuses_an_architecture_it_does_not_serve(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _refused(path, "'falcon'", "deepseek2, qwen3moe, qwen2moe, llama")


def test_refuses_a_dense_llama(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    key = b"llama.expert_count"
    at = data.index(key) + len(key) + 4  # NOTE: past the key and its value type (u32)
    patched = data[:at] + struct.pack("<I", 0) + data[at + 4 :]
    small_gguf.write_bytes(patched)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        HFConfig.from_checkpoint(small_gguf)


def _tensor_type_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s ggml type (u32) lies in its header entry."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return tensor.field.offset + 8 + len(name.encode()) + 4 + 8 * len(tensor.shape)


@pytest.mark.parametrize("raw, phrase", [(999, "ggml type 999 (unknown)"), (26, "I32")])
def test_refuses_a_type_it_cannot_read(small_gguf, raw, phrase):
    at = _tensor_type_offset(small_gguf, "blk.1.ffn_down_exps.weight")
    data = bytearray(small_gguf.read_bytes())
    assert struct.unpack_from("<I", data, at)[0] == gguf.GGMLQuantizationType.BF16
    struct.pack_into("<I", data, at, raw)
    small_gguf.write_bytes(bytes(data))
    _refused(small_gguf, "blk.1.ffn_down_exps.weight", phrase, "readable types:", "Q4_K")


def test_refuses_tensors_that_do_not_match_the_metadata(tmp_path, seed):
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 40  # NOTE: the metadata now says 40; the experts have 36
    (checkpoint / "config.json").write_text(json.dumps(config))
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf")
    _refused(first, "blk.0.ffn_gate_exps.weight", "[8, 36, 48]", "[8, 40, 48]")


def test_refuses_an_incomplete_split_set(tmp_path, seed):
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf", split_max_tensors=5)
    files = sorted(tmp_path.glob("m-*.gguf"))
    files[1].unlink()
    _refused(first, "incomplete", files[1].name, "missing")


def test_refuses_a_split_file_served_alone(tmp_path, seed):
    """A split set's file renamed as if it were the whole model: its split.count says not."""
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf", split_max_tensors=5)
    alone = tmp_path / "alone" / "model.gguf"
    alone.parent.mkdir()
    shutil.copy(first, alone)
    _refused(alone, "incomplete", "split.count")


def test_refuses_a_directory_of_two_models(small_gguf):
    shutil.copy(small_gguf, small_gguf.with_name("other.gguf"))
    _refused(small_gguf.parent, "several models", "model, other")


def test_one_mapping_per_process_for_the_same_files(small_gguf):
    assert open_checkpoint(small_gguf) is open_checkpoint(small_gguf.parent)
