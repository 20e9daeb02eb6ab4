"""`python -m model.convert SRC DST [--routed-experts nvfp4] [--kv-cache-dtype nvfp4]`

Converts a float (bf16/fp32) MiniMax-M3 checkpoint into the M3.1-Flash storage: routed experts
quantized to NVFP4 with model/nvfp4.py (the project's one quantization function) in the ModelOpt
per-expert layout, everything else copied; the output is in the released checkpoints' layout (the
`minimax_m3_vl` wrapper config, checkpoint tensor names) whatever layout the float source had.
Streams tensor by tensor (never builds the model), so it runs on checkpoints far larger than memory;
shards are written atomically, the index last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from model import nvfp4
from model.checkpoint import _EXPERT_RE, CheckpointError, ShardWriter, iter_tensors
from model.config import ModelConfig
from model.hf_layout import from_port_names
from model.layers.moe import quantize_expert_nvfp4


def convert(src: str | os.PathLike, dst: str | os.PathLike, routed_experts: str = "nvfp4",
            kv_cache_dtype: str | None = None, max_shard_bytes: int = 2 << 30) -> ModelConfig:  # fmt: skip
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_pretrained(src)
    if cfg.quantization.routed_experts != "bf16":
        raise CheckpointError(
            f"{src}: routed experts are already {cfg.quantization.routed_experts}; "
            "convert from a bf16 checkpoint"
        )
    if routed_experts != "nvfp4":
        raise ValueError(f"--routed-experts {routed_experts!r} is not supported; only 'nvfp4'")
    quant = dataclasses.replace(cfg.quantization, routed_experts="nvfp4", exclude_modules=[])
    new_cfg = dataclasses.replace(
        cfg, quantization=quant, kv_cache_dtype=kv_cache_dtype or cfg.kv_cache_dtype
    )

    writer = ShardWriter(dst, max_shard_bytes)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # expert prefix -> {w1, w2, w3} float weights
    for name, t in from_port_names(iter_tensors(src)):  # a float source may be in the port's layout
        m = _EXPERT_RE.match(name)
        if m and m.group(5) == "weight":
            # w1 and w3 share a global scale (see quantize_expert_nvfp4): wait for all three.
            expert = name.rsplit(".", 2)[0]
            pending.setdefault(expert, {})[m.group(4)] = t
            if len(pending[expert]) < 3:
                continue
            w = pending.pop(expert)
            out = {}
            for proj, q in quantize_expert_nvfp4(w["w1"], w["w3"], w["w2"]).items():
                out.update(nvfp4.to_modelopt(f"{expert}.{proj}.", q))
        else:
            out = {name: t}
        for k, v in out.items():
            writer.add(k, v)
    if pending:
        raise CheckpointError(
            f"{src}: experts missing some of w1/w2/w3: {sorted(pending)[:5]}; the checkpoint is partial"
        )
    new_cfg.save_pretrained(dst)
    writer.close()
    return new_cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.convert", description=__doc__.split("\n\n")[1])
    p.add_argument("src", help="directory of a bf16/fp32 checkpoint (config.json + safetensors)")
    p.add_argument("dst", help="output directory (created)")
    p.add_argument("--routed-experts", default="nvfp4", choices=["nvfp4"])
    p.add_argument("--kv-cache-dtype", default=None, choices=["bf16", "fp8", "nvfp4"])
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    args = p.parse_args(argv)
    try:
        cfg = convert(
            args.src, args.dst, args.routed_experts, args.kv_cache_dtype, int(args.max_shard_gb * 2**30)
        )
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.dst}: routed experts {cfg.quantization.routed_experts}, kv cache {cfg.kv_cache_dtype}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
