"""Checkpoints: ModelOpt-layout round trips, bf16 -> NVFP4 conversion, clear errors on bad files."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, base_fingerprint, load_model, save_model
from model.config import ModelConfig, QuantConfig
from model.convert import convert
from model.integrity import MANIFEST_FILE, write_manifest
from model.modeling import MiniMaxM3ForCausalLM

IDS = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0))


def make(cfg: ModelConfig, seed: int = 0) -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=seed).eval()


@pytest.fixture(scope="module")
def bf16_cfg() -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig(routed_experts="bf16"))


@torch.no_grad()
def test_nvfp4_tiny_checkpoint_round_trip_is_identical_and_sharded(tmp_path):
    model = make(ModelConfig.preset("tiny"))
    save_model(model, tmp_path / "ckpt", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    name = "model.layers.1.block_sparse_moe.experts.3.w1"
    assert index["weight_map"].keys() >= {f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_scale_2"}
    loaded = load_model(tmp_path / "ckpt", dtype=torch.float32)
    assert base_fingerprint(loaded) == base_fingerprint(model)
    assert torch.equal(loaded(IDS), model(IDS))
    # Buffers that are not in the checkpoint (KV scales) are re-initialised, not left as garbage.
    loaded.config.kv_cache_dtype = model.config.kv_cache_dtype = "nvfp4"
    assert torch.equal(loaded(IDS, kv_sim=True), model(IDS, kv_sim=True))
    shard = load_file(tmp_path / "ckpt" / index["weight_map"][f"{name}.weight"])
    assert shard[f"{name}.weight"].dtype == torch.uint8
    assert shard[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn


@torch.no_grad()
def test_bf16_checkpoint_converted_to_nvfp4_equals_quantize_on_load(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg, seed=1), tmp_path / "bf16")
    out = subprocess.run(
        [sys.executable, "-m", "model.convert", str(tmp_path / "bf16"), str(tmp_path / "nvfp4")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    converted = load_model(tmp_path / "nvfp4", dtype=torch.float32)
    assert converted.config.quantization.routed_experts == "nvfp4"
    nvfp4_cfg = dataclasses.replace(bf16_cfg, quantization=QuantConfig(routed_experts="nvfp4"))
    on_load = load_model(tmp_path / "bf16", dtype=torch.float32, config=nvfp4_cfg)
    assert base_fingerprint(converted) == base_fingerprint(on_load)
    assert torch.equal(converted(IDS), on_load(IDS))
    # ...and quantization really happened: outputs differ from the bf16 original.
    original = load_model(tmp_path / "bf16", dtype=torch.float32)
    assert not torch.equal(original(IDS), converted(IDS))


def test_convert_refuses_an_already_quantized_checkpoint(tmp_path):
    save_model(make(ModelConfig.preset("tiny")), tmp_path / "q")
    with pytest.raises(CheckpointError, match="already nvfp4"):
        convert(tmp_path / "q", tmp_path / "out")


def _single_file_ckpt(tmp_path, cfg) -> tuple:
    save_model(make(cfg), tmp_path, max_shard_bytes=1 << 40)
    (shard,) = list(tmp_path.glob("model-*.safetensors"))
    return shard, load_file(shard)


def test_missing_tensor_is_named(tmp_path, bf16_cfg):
    shard, tensors = _single_file_ckpt(tmp_path, bf16_cfg)
    del tensors["model.layers.2.self_attn.o_proj.weight"]
    save_file(tensors, shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.o_proj.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    write_manifest(tmp_path, [shard.name])  # a consistent checkpoint that simply lacks the tensor
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.2\.self_attn\.o_proj"):
        load_model(tmp_path)


def test_unexpected_tensor_and_shape_mismatch_are_named(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path)
    wider = dataclasses.replace(bf16_cfg, dense_intermediate_size=512)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_model(tmp_path, config=wider)
    fewer_layers = dataclasses.replace(
        bf16_cfg,
        num_hidden_layers=3,
        layer_types=bf16_cfg.layer_types[:3],
        mlp_layer_types=bf16_cfg.mlp_layer_types[:3],
    )
    with pytest.raises(CheckpointError, match=r"no place in this model.*layers\.3"):
        load_model(tmp_path, config=fewer_layers)


def test_truncated_shard_gives_clear_error(tmp_path, bf16_cfg):
    shard, _ = _single_file_ckpt(tmp_path, bf16_cfg)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(tmp_path)


def test_unknown_quant_algo_is_rejected(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "INT3_MAGIC"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="INT3_MAGIC"):
        load_model(tmp_path)


def test_not_a_checkpoint_directory(tmp_path, bf16_cfg):
    bf16_cfg.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------ checksum manifest
def _flip_byte(path, at_fraction: float = 0.7) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at_fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def test_saved_checkpoint_has_a_manifest_covering_every_shard(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path, max_shard_bytes=200_000)
    listed = set(json.loads((tmp_path / MANIFEST_FILE).read_text())["files"])
    assert listed == {p.name for p in tmp_path.glob("model-*.safetensors")} and len(listed) > 1


def test_bit_flipped_shard_is_named_before_any_weight_loads(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path, max_shard_bytes=200_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    _flip_byte(shard)  # inside the tensor data: safetensors itself would load it without complaint
    with pytest.raises(CheckpointError, match=rf"file {shard.name} is corrupted.*re-download"):
        load_model(tmp_path)


def test_truncated_shard_with_manifest_names_sizes(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path)
    shard = next(tmp_path.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=rf"{shard.name} is truncated \(\d+ bytes, the manifest records"
    ):
        load_model(tmp_path)


def test_checkpoint_without_manifest_loads_with_one_warning(tmp_path, bf16_cfg, caplog):
    model = make(bf16_cfg)
    save_model(model, tmp_path)
    (tmp_path / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="model.integrity"):
        a = load_model(tmp_path, dtype=torch.float32)
        load_model(tmp_path, dtype=torch.float32)
    assert caplog.text.count("without checksum verification") == 1
    assert base_fingerprint(a) == base_fingerprint(model.float())


def test_garbled_manifest_is_an_error_naming_the_fix(tmp_path, bf16_cfg):
    save_model(make(bf16_cfg), tmp_path)
    (tmp_path / MANIFEST_FILE).write_text('{"files": [1, 2')
    with pytest.raises(CheckpointError, match=r"unreadable checksum manifest.*delete checksums\.json"):
        load_model(tmp_path)


def test_adapter_weights_bit_flip_and_truncation_are_named(tmp_path):
    from model.adapter import WEIGHTS_FILE, AdapterError, read_adapter, save_adapter
    from model.layers.lora import LoRAConfig, apply_lora

    model = apply_lora(make(ModelConfig.preset("tiny")), LoRAConfig(r=4, target_modules=["q_proj"]))
    save_adapter(model, tmp_path, LoRAConfig(r=4, target_modules=["q_proj"]))
    assert set(json.loads((tmp_path / MANIFEST_FILE).read_text())["files"]) == {WEIGHTS_FILE}
    read_adapter(tmp_path)
    good = (tmp_path / WEIGHTS_FILE).read_bytes()
    _flip_byte(tmp_path / WEIGHTS_FILE, 0.9)
    with pytest.raises(AdapterError, match=rf"adapter .*{WEIGHTS_FILE} is corrupted"):
        read_adapter(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(good[:-8])
    with pytest.raises(AdapterError, match=rf"{WEIGHTS_FILE} is truncated"):
        read_adapter(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(good)
    (tmp_path / MANIFEST_FILE).unlink()  # a PEFT-written adapter: no manifest, still readable
    assert read_adapter(tmp_path)[0].r == 4


def test_directory_fingerprint_names_files_and_dtype_and_needs_no_manifest(tmp_path):
    """The identity a vLLM engine reports for the directory it serves: the same for a copy and with
    or without checksums.json (its digests are the files' own), different for another dtype or other
    weights, and a corrupted shard is named instead of fingerprinted."""
    import shutil

    from model.checkpoint import directory_fingerprint

    cfg = ModelConfig.preset("tiny")
    save_model(make(cfg), tmp_path / "a")
    save_model(make(cfg, seed=1), tmp_path / "b")
    fp = directory_fingerprint(tmp_path / "a", torch.float32)
    assert fp.startswith("dir1:")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert directory_fingerprint(tmp_path / "copy", torch.float32) == fp
    (tmp_path / "copy" / MANIFEST_FILE).unlink()
    assert directory_fingerprint(tmp_path / "copy", torch.float32) == fp  # every file hashed instead
    assert directory_fingerprint(tmp_path / "a", torch.bfloat16) != fp
    assert directory_fingerprint(tmp_path / "b", torch.float32) != fp
    shard = sorted((tmp_path / "a").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        directory_fingerprint(tmp_path / "a", torch.float32)
    # verify=False (a learner that has just loaded the verified files): the manifest, no second read
    assert directory_fingerprint(tmp_path / "a", torch.float32, verify=False) == fp
