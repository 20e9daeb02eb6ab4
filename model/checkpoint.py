"""Checkpoints: sharded safetensors in and out, ModelOpt NVFP4 / MXFP8 / FP8 layouts, base fingerprint.

What: `load_model` builds on the meta device and streams tensors in (routed experts stay in their
stored format); `save_model` writes config.json, shards, the index and `checksums.json` last;
`base_fingerprint` hashes the frozen base so learner and engines prove they hold the same bits
(docs/ARCHITECTURE.md, "Invariants"; layouts in docs/FACTS.md, "ModelOpt checkpoint conventions").
Invariants: routed experts round-trip bit for bit; shards are verified against the manifest before
they are read; every error names the file, the tensor and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from model import nvfp4
from model.config import ModelConfig
from model.hf_config import checkpoint_layout
from model.hf_layout import from_port_names, to_port_names
from model.integrity import (
    IntegrityError,
    file_sha256,
    fsync_path,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from model.layers.attention import Attention
from model.layers.moe import ExpertBank
from model.modeling import MiniMaxM3ForCausalLM
from model.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from model.vision.weights import VisionWeightError, load_vision_checkpoint, vision_state_for_save

# Design notes (moved from the module docstring)
# What: `load_model(path)` builds the model on the meta device (so a 428B config costs nothing),
# materialises it on the target device and streams the checkpoint in tensor by tensor; routed
# experts go straight into their bank in their stored format (NVFP4 stays packed). `save_model`
# writes config.json (+ hf_quant_config.json), shards and `model.safetensors.index.json`.
# `base_fingerprint` hashes the frozen base so the learner and every engine can prove they hold the
# same bits (docs/ARCHITECTURE.md, "Invariants").
#
# On-disk conventions (docs/FACTS.md, "ModelOpt checkpoint conventions"): a quantized linear `X`
# is `X.weight` (NVFP4: uint8
# [N, K/2]; MXFP8/FP8: float8_e4m3fn [N, K]) plus `X.weight_scale` (NVFP4: e4m3 [N, K/16]; MXFP8:
# E8M0 uint8 [N, K/32], spelled `weight_scale_inv` in M3 checkpoints; FP8: fp32 per-tensor), and
# for NVFP4 `X.weight_scale_2` (fp32) and optionally `X.input_scale`. Routed experts are stored per
# expert: `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w2,w3}.*`.
#
# In memory only the routed experts keep their stored format. Other quantized groups (MXFP8
# attention, dense and shared MLPs of M3.1-Flash) are dequantized once at load into the model's
# float dtype (exact in fp32; bf16 rounds NVFP4 values times an fp32 scale_2), and `save_model`
# re-quantizes them; re-quantizing a dequantized tensor can move scale_2 by an ulp, so a re-saved
# non-expert NVFP4 module is equal to ~1e-7 relative, not bit for bit. Routed experts round-trip
# bit for bit.
#
# Errors name the file, the tensor and the fix: missing or unexpected tensors, shape mismatches,
# unknown quantization algorithms (raised by ModelConfig) and truncated or corrupt shards.
#
# Vision (configs with a vision part): the tower and projector are saved and loaded under the released
# checkpoint's top-level names (`vision_tower.*`, `multi_modal_projector.*`, `patch_merge_mlp.*`) by
# model/vision/weights.py, stored as the vision config's `weight_dtype` says (bf16 by default; MXFP8
# if configured), never through the text model's quantization groups: an NVFP4 text config never
# quantizes a vision weight. A text-only config skips those tensors of a VL checkpoint.
#
# Integrity: `ShardWriter.close()` writes the index, then `checksums.json` (sha256 + size of every
# shard, model/integrity.py) last, atomically; readers (`iter_tensors`, hence `load_model` and
# `model.convert`) verify the shards they are about to read against it first, so a truncated or
# bit-flipped shard fails with the file named instead of loading wrong weights. Directories without
# a manifest (older or upstream checkpoints) load with one warning.

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(\w+)$")
_QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")
# Tensors the text model deliberately does not hold: the vision tower of `minimax_m3_vl`
# checkpoints and the MTP module (optional for this project; DSpark is its speculative decoder).
_SKIPPED_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.", "mtp.",
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into, or one that is missing, partial
    or damaged (model checkpoints here, training checkpoints in rl/checkpointing.py); the message
    names the file or tensor."""


# ---------------------------------------------------------------------------- reading
def _shard_files(path: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index file or the single-file layout."""
    if (path / INDEX_FILE).exists():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(
                f"{path / INDEX_FILE}: not a valid safetensors index ({e}); re-create it"
            ) from e
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(f"{path}: shard files listed in {INDEX_FILE} are missing: {missing[:5]}")
        return {name: path / f for name, f in weight_map.items()}
    if (path / SINGLE_FILE).exists():
        return {name: path / SINGLE_FILE for name in _keys(path / SINGLE_FILE)}
    raise CheckpointError(
        f"{path}: no {INDEX_FILE} or {SINGLE_FILE}; is this a safetensors checkpoint directory?"
    )


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise CheckpointError(
            f"{file}: cannot read safetensors header ({e}); the file is truncated or corrupt"
        ) from e


def verify_shards(path: str | os.PathLike, only: Callable[[str], bool] | None = None) -> bool:
    """Check every shard of the checkpoint at `path` (with `only`: every shard holding a tensor name
    it accepts) against its checksums.json. True: verified; False: no manifest (older checkpoint,
    warned once); CheckpointError naming the bad shard."""
    path = Path(path)
    if not (path / INDEX_FILE).exists() and (path / SINGLE_FILE).exists():
        shards = {SINGLE_FILE}  # before parsing its header, which a damaged file may break
    else:
        shards = {f.name for name, f in _shard_files(path).items() if only is None or only(name)}
    try:
        return verify_manifest(path, shards, what="model checkpoint")
    except IntegrityError as e:
        raise CheckpointError(str(e)) from None


def iter_tensors(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    verify: bool = True,
    only: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs shard by shard; one tensor is resident at a time. `verify`
    first checks the shards' checksums (one extra read of the files; see `verify_shards`). `only`
    (a predicate on stored names): the other tensors are neither read nor verified (an
    expert-parallel rank reads its own experts' bytes only)."""
    path = Path(path)
    if verify:
        verify_shards(path, only)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in _shard_files(path).items():
        if only is None or only(name):
            by_file[file].append(name)
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                for name in sorted(names):
                    if name not in present:
                        raise CheckpointError(f"{file}: index lists {name!r} but the shard does not hold it")
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{file}: cannot read tensors ({e}); the file is truncated or corrupt"
            ) from e


def _canonical(name: str) -> str:
    """Map `minimax_m3_vl` checkpoint names onto the text model's names."""
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model.") :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def _dequant_linear(tensors: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> torch.Tensor:
    """A linear weight in any stored format -> float weight [N, K]."""
    w = tensors["weight"]
    scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
    if w.dtype == torch.uint8 and "weight_scale_2" in tensors:
        t = nvfp4.from_modelopt({f"x.{k}": v for k, v in tensors.items()}, "x.")
        return nvfp4.dequantize(t, dtype)
    if w.dtype == torch.float8_e4m3fn and scale is not None and scale.dtype == torch.uint8:
        return dequantize_mxfp8(w, scale, dtype)
    if w.dtype == torch.float8_e4m3fn and scale is not None and scale.numel() in (1, w.shape[0]):
        return (w.float() * scale.float().reshape(-1, 1)).to(dtype)
    if w.is_floating_point() and w.dtype != torch.float8_e4m3fn and scale is None:
        return w.to(dtype)
    extras = sorted(k for k in tensors if k != "weight")
    raise CheckpointError(
        f"{where}: unsupported weight storage (weight {w.dtype}, scales {extras}); supported: float, "
        "NVFP4 (uint8 + weight_scale + weight_scale_2), MXFP8 (e4m3 + E8M0 uint8), FP8 per-tensor"
    )


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: ModelConfig | None = None,
    verify: bool = True,
    expert_range: tuple[int, int] | None = None,
) -> MiniMaxM3ForCausalLM:
    """Load a checkpoint directory written by `save_model`, `model.convert` or upstream.

    `config` overrides the directory's config.json, e.g. to quantize bf16 experts to NVFP4 while
    loading (the bank quantizes each expert as it arrives: the bf16 bank never exists whole).
    `verify` checks the shards against checksums.json before reading any weight.
    `expert_range` [lo, hi): every routed-expert bank holds (allocates, reads, verifies) only those
    experts, as an expert-parallel rank needs (`expert_ranges(E, W)[rank]`); the model then runs
    only under `model.parallel.expert_parallel.apply_expert_parallel` with that rank's range.
    """
    path = Path(path)
    cfg = config or ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg)
    lo, hi = _check_expert_range(expert_range, cfg, path)
    if expert_range is not None:
        for _, moe in _moe_blocks(model):
            moe.experts = ExpertBank.empty_shard(moe.experts, lo, hi)
    model.to_empty(device=device)
    model.to(dtype)  # float parameters only; quantized buffers keep their integer/fp8 dtypes
    _restore_fp32_parts(model)
    # Buffers not stored in checkpoints are garbage after `to_empty`: the KV scales get their
    # defaults here, and calibrated `self_attn.k_scale` / `v_scale` tensors (vLLM's names) in the
    # checkpoint overwrite them below.
    for module in model.modules():
        if isinstance(module, Attention):
            module.reset_kv_scales()
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    expert_names = {n for n in targets if ".block_sparse_moe.experts." in n}
    pending_linear: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    pending_expert: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
    loaded: set[str] = set()
    unexpected: list[str] = []
    banks = dict(_banks(model))

    def wanted(raw_name: str) -> bool:  # other ranks' experts are never read
        m = _EXPERT_RE.match(_canonical(raw_name))
        return m is None or lo <= int(m.group(3)) < hi

    only = None if expert_range is None else wanted
    stream = ((_canonical(n), t) for n, t in iter_tensors(path, device="cpu", verify=verify, only=only))
    for name, tensor in from_port_names(stream):  # a float checkpoint in the port's layout
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        m = _EXPERT_RE.match(name)
        if m:
            bank_name, e, proj, suffix = m.group(1), int(m.group(3)), m.group(4), m.group(5)
            if not lo <= e < hi:  # split from a stacked port tensor: another rank's expert
                continue
            if bank_name not in banks:
                unexpected.append(name)
                continue
            pending_expert[(bank_name, e)][f"{proj}.{suffix}"] = tensor
            if len(pending_expert[(bank_name, e)]) == _expert_tensor_count(pending_expert[(bank_name, e)]):
                _load_expert(banks[bank_name], bank_name, e, pending_expert.pop((bank_name, e)), device, path)
                loaded.add(f"{bank_name}.{e}")
            continue
        module, _, suffix = name.rpartition(".")
        if suffix in _QUANT_SUFFIXES or (
            suffix == "weight" and tensor.dtype in (torch.uint8, torch.float8_e4m3fn)
        ):
            pending_linear[module][suffix] = tensor
            continue
        if name not in targets:
            unexpected.append(name)
            continue
        _copy_into(targets[name], tensor, name, path)
        loaded.add(name)

    for module, tensors in pending_linear.items():
        name = f"{module}.weight"
        if name not in targets:
            unexpected.append(name)
            continue
        _copy_into(
            targets[name], _dequant_linear(tensors, targets[name].dtype, f"{path}: {module}"), name, path
        )
        loaded.add(name)
    for (bank_name, e), tensors in pending_expert.items():  # incomplete experts
        raise CheckpointError(
            f"{path}: expert {bank_name}.{e} is incomplete (has {sorted(tensors)}); the checkpoint is partial"
        )
    if model.vision is not None:  # its own reader: only the shards holding vision tensors
        try:
            load_vision_checkpoint(model.vision, path)
        except VisionWeightError as e:
            raise CheckpointError(f"{path}: {e}") from e
        loaded.update(f"vision.{n}" for n, _ in model.vision.named_parameters())

    if unexpected:
        raise CheckpointError(
            f"{path}: {len(unexpected)} tensors have no place in this model, e.g. {unexpected[:5]}; "
            "the checkpoint belongs to a different architecture or config.json does not match it"
        )
    missing = [n for n in targets if n not in loaded and n not in expert_names and not _is_derived(n)]
    missing_experts = [
        f"{layer}.{e}"
        for layer, bank in banks.items()
        for e in range(bank.first_expert, bank.first_expert + bank.num_experts)
        if f"{layer}.{e}" not in loaded
    ]
    missing += missing_experts
    if missing:
        raise CheckpointError(
            f"{path}: missing tensors {missing[:5]} ({len(missing)} in all); "
            "the checkpoint is partial or was written for another config"
        )
    model.requires_grad_(False)
    return model.eval()


def _expert_tensor_count(have: dict[str, torch.Tensor]) -> int:
    """How many tensors one complete expert has, judged from what arrived (format-dependent)."""
    per_proj = {"weight"} | {k.split(".", 1)[1] for k in have}
    return 3 * len(per_proj)


def _load_expert(bank, bank_name: str, e: int, tensors: dict[str, torch.Tensor], device, path: Path) -> None:
    """Global expert `e` into its row of `bank` (a partial bank: row e - first_expert)."""
    if e >= bank.total_experts:
        raise CheckpointError(
            f"{path}: expert index {e} in {bank_name} >= num_local_experts {bank.total_experts}"
        )
    try:
        bank.load_expert_state(e - bank.first_expert, {k: v.to(device) for k, v in tensors.items()})
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: {bank_name}.{e}: {err}") from err


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{path}: {name} has shape {tuple(tensor.shape)} in the checkpoint but the model expects "
            f"{tuple(target.shape)}; config.json does not match the weights"
        )
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def _restore_fp32_parts(model: MiniMaxM3ForCausalLM) -> None:
    """The router runs in fp32 (docs/FACTS.md, "M3 architecture") whatever the model dtype."""
    for _, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            module.gate.float()
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()


def _is_derived(name: str) -> bool:
    """Buffers computed at construction (not stored in checkpoints)."""
    return name.endswith(("inv_freq", "k_scale", "v_scale", "index_k_scale"))


def _check_expert_range(expert_range, cfg: ModelConfig, path: Path) -> tuple[int, int]:
    """[lo, hi) to keep (the whole layer without `expert_range`), validated against the config."""
    e = cfg.num_local_experts
    if expert_range is None:
        return 0, e
    lo, hi = expert_range
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if not (0 <= lo < hi <= e) or not n_moe:
        raise CheckpointError(
            f"{path}: expert_range={tuple(expert_range)} is not a non-empty range of this model's "
            f"{e} routed experts (MoE layers: {n_moe}); use "
            "model.parallel.expert_parallel.expert_ranges(num_experts, world)[rank]"
        )
    return lo, hi


def _moe_blocks(model: MiniMaxM3ForCausalLM):
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            yield i, layer.block_sparse_moe


def _banks(model: MiniMaxM3ForCausalLM):
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            yield f"model.layers.{i}.block_sparse_moe.experts", layer.block_sparse_moe.experts


# ---------------------------------------------------------------------------- writing
def state_for_save(model: MiniMaxM3ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) in the config's storage format, one tensor at a time."""
    cfg = model.config
    bank_prefixes = tuple(f"{name}." for name, _ in _banks(model))
    for name, t in model.state_dict().items():
        if name.startswith(bank_prefixes) or _is_derived(name) or "lora_" in name:
            continue  # adapters are saved by model/adapter.py, never as base weights
        if name.startswith("vision."):
            continue  # written below under the checkpoint's names, in the vision storage dtype
        module = name.rpartition(".")[0]
        fmt = cfg.module_dtype(module) if name.endswith(".weight") and t.dim() == 2 else "bf16"
        if name.startswith(("lm_head", "model.embed_tokens")) or ".norm" in name or "layernorm" in name:
            fmt = "bf16"
        if fmt == "mxfp8":
            values, scales = quantize_mxfp8(t.float())
            yield name, values
            yield f"{module}.weight_scale", scales
        elif fmt == "nvfp4":
            for k, v in nvfp4.to_modelopt(f"{module}.", nvfp4.quantize(t.float())).items():
                yield k, v
        elif fmt == "fp8":
            scale = t.float().abs().amax().clamp(min=1e-12) / 448.0
            yield name, (t.float() / scale).to(torch.float8_e4m3fn)
            yield f"{module}.weight_scale", scale
        else:
            yield name, t.detach().contiguous()
    if model.vision is not None:
        yield from vision_state_for_save(model.vision).items()
    for bank_name, bank in _banks(model):
        for e in range(bank.num_experts):
            for k, v in bank.expert_state(e).items():
                yield f"{bank_name}.{e}.{k}", v.detach().contiguous()


class ShardWriter:
    """Streams tensors into `model-NNNNN.safetensors` shards of about `max_shard_bytes`, each written
    to a temp name, fsynced and renamed; `close()` writes `model.safetensors.index.json`, then the
    shards' checksum manifest, so a reader never sees an index that points at a missing or partial
    shard, nor a manifest for shards that are not complete."""

    def __init__(self, path: Path, max_shard_bytes: int = 2 << 30):
        self.path, self.max_shard_bytes = path, max_shard_bytes
        path.mkdir(parents=True, exist_ok=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._size = self._count = self._total = 0
        self._weight_map: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self._shard and self._size + nbytes > self.max_shard_bytes:
            self._flush()
        # 0-d tensors may share storage (w1/w3's common scale_2): safetensors wants their own.
        self._shard[name] = t.detach().cpu().clone() if t.dim() == 0 else t.detach().cpu().contiguous()
        self._size += nbytes

    def _flush(self) -> None:
        if not self._shard:
            return
        self._count += 1
        fname = f"model-{self._count:05d}.safetensors"
        tmp = self.path / f".{fname}.tmp"
        save_file(self._shard, str(tmp), metadata={"format": "pt"})
        fsync_path(tmp)
        os.replace(tmp, self.path / fname)
        for name in self._shard:
            self._weight_map[name] = fname
        self._total += self._size
        self._shard, self._size = {}, 0

    def close(self) -> None:
        self._flush()
        index = {
            "metadata": {"total_size": self._total},
            "weight_map": dict(sorted(self._weight_map.items())),
        }
        tmp = self.path / f".{INDEX_FILE}.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, self.path / INDEX_FILE)
        write_manifest(self.path, set(self._weight_map.values()))


def save_model(model: MiniMaxM3ForCausalLM, path: str | os.PathLike, max_shard_bytes: int = 2 << 30) -> None:
    """Write config + shards + index, one tensor resident at a time beyond the current shard (one
    layer's experts for a float model, whose tensors take the port's names: model/hf_layout.py)."""
    if any(bank.is_partial for _, bank in _banks(model)):
        raise CheckpointError(
            "save_model: the model holds a shard of its experts (an expert-parallel rank); save the base "
            "from a whole model (load_model without expert_range)"
        )
    path = Path(path)
    writer = ShardWriter(path, max_shard_bytes)
    model.config.save_pretrained(path)
    items = state_for_save(model)
    if checkpoint_layout(model.config) == "text":
        items = to_port_names(items, model.config.num_local_experts)
    for name, t in items:
        writer.add(name, t)
    writer.close()


# ---------------------------------------------------------------------------- identity
FINGERPRINT_PREFIX = "fp2:"
"""Marks the fingerprint format: routed experts hashed per expert, so expert-parallel shards can
combine theirs."""


def base_fingerprint(
    model: torch.nn.Module,
    skip: tuple[str, ...] = ("lora_",),
    group: dist.ProcessGroup | None = None,
) -> str:
    """sha256 over every base tensor (names sorted; adapter tensors skipped): name, dtype, and its
    bytes, or for a routed-expert bank tensor [E, ...] the sha256 digests of its E expert rows in
    global expert order. Equal fingerprints on the learner and an engine mean bit-identical NVFP4
    codes, scales and weights, however each holds its experts: a model with partial banks (an
    expert-parallel rank) gathers the other ranks' row digests over `group` (None: the default
    group; collective: every rank of it calls this), so its fingerprint is the whole model's."""
    # Persistent state only: wrappers such as ExpertParallelMoE add non-persistent bookkeeping buffers.
    transient = {
        f"{prefix}.{b}" if prefix else b
        for prefix, m in model.named_modules()
        for b in m._non_persistent_buffers_set
    }
    tensors = {
        **dict(model.named_parameters()),
        **{n: b for n, b in model.named_buffers() if n not in transient},
    }
    banks = {f"{n}.": b for n, b in model.named_modules() if isinstance(b, ExpertBank)}

    def bank_of(name: str) -> ExpertBank | None:
        prefix, _, leaf = name.rpartition(".")
        return banks.get(f"{prefix}.") if "." not in leaf else None

    names = [n for n in sorted(tensors) if not any(s in n for s in skip) and not _is_derived(n)]
    rows: dict[str, list[bytes]] = {}  # bank tensor -> this process's expert-row digests
    for name in names:
        if bank_of(name) is not None:
            t = _host_bytes_view(tensors[name])
            rows[name] = [hashlib.sha256(r.numpy().tobytes()).digest() for r in t.reshape(t.shape[0], -1)]
    if any(b.is_partial for b in banks.values()):
        rows = _gather_expert_rows(rows, banks, bank_of, group)
    h = hashlib.sha256()
    for name in names:
        t = tensors[name]
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(b"".join(rows[name]) if name in rows else _host_bytes_view(t).numpy().tobytes())
    return FINGERPRINT_PREFIX + h.hexdigest()


DIRECTORY_FINGERPRINT_PREFIX = "dir1:"


def directory_fingerprint(path: str | os.PathLike, dtype: torch.dtype, verify: bool = True) -> str:
    """A base directory's identity as a learner loads it, without loading it: sha256 over config.json,
    each tensor file's name and sha256, and the dtype the model is held in. With a checksums.json the
    files are verified against it first (streamed, constant memory) and its digests are used; without
    one (an upstream release) every file is hashed. Equal values: byte-identical files loaded by the
    same rule. Used where an engine serves the directory itself (vLLM) and so holds no model of ours
    to `base_fingerprint`: no host copy of a 248 GB base just to compare it with the learner's.
    `verify=False`: the manifest's digests without re-reading the files (a caller that has just
    loaded the directory with verification)."""
    path = Path(path)
    files = sorted({f.name for f in _shard_files(path).values()})
    if verify:
        verify_shards(path)  # CheckpointError naming a bad shard
    manifest = read_manifest(path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    h.update(str(dtype).encode())
    for name in files:
        h.update(name.encode())
        h.update((manifest[name]["sha256"] if manifest else file_sha256(path / name)).encode())
    return DIRECTORY_FINGERPRINT_PREFIX + h.hexdigest()


def _host_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the host as uint8, leading dimension kept."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).reshape(t.shape[0], -1) if t.dim() else t.reshape(1).view(torch.uint8)


def _gather_expert_rows(rows: dict[str, list[bytes]], banks: dict, bank_of, group) -> dict[str, list[bytes]]:
    """Every rank's expert-row digests, concatenated in global expert order (collective)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "base_fingerprint: the model holds a shard of its experts (load_model(expert_range=...)) but "
            "torch.distributed is not initialized; fingerprint it on every rank of its expert-parallel group"
        )
    mine = {name: (bank_of(name).first_expert, digests) for name, digests in rows.items()}
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    out: dict[str, list[bytes]] = {}
    for name in rows:
        total = bank_of(name).total_experts
        held = {}
        for part in parts:
            first, digests = part[name]
            held.update({first + i: d for i, d in enumerate(digests)})
        if sorted(held) != list(range(total)):
            raise RuntimeError(
                f"base_fingerprint: the group's shards of {name} hold experts {sorted(held)[:8]}... "
                f"not all {total} exactly once; every rank must load expert_ranges(E, W)[rank]"
            )
        out[name] = [held[e] for e in range(total)]
    return out
