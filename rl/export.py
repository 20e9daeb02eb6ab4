"""Export a trained adapter for serving: `python -m rl.export SRC --out DIR [--format peft|merged]`.

What: SRC is an adapter directory or a run directory (the adapter of the highest step is taken).
`peft` validates the adapter (optionally against `--base`), copies it and writes a README card;
`merged` loads the base, checks the adapter's recorded fingerprint, folds the adapter in and saves a
checkpoint in the base's storage formats. Invariants: a mismatched base is refused; outputs appear
whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model.adapter import (
    CONFIG_FILE,
    METADATA_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterMetadata,
    load_adapter,
    read_adapter,
)
from model.checkpoint import base_fingerprint, load_model, save_model
from model.config import ModelConfig
from model.integrity import write_manifest
from model.layers.lora import LoRAConfig, LoRALinear, apply_lora, load_lora_state_dict, merge_lora
from model.layers.moe import ExpertBank
from model.modeling import MiniMaxM3ForCausalLM

# Design notes (moved from the module docstring)
# What: SRC is an adapter directory (adapter_config.json + adapter_model.safetensors) or a run
# directory holding one or more (the one with the highest recorded training step is taken).
# - `--format peft` (default): validates the adapter (and, with `--base`, that it fits that base's
#   shapes, built on the meta device so nothing is loaded), copies its files to DIR and writes a
#   README.md card (base, rank, alpha, targets, step, metrics, size, how to serve it).
# - `--format merged`: loads the base (`--base`, else the adapter's base_model_name_or_path),
#   checks its fingerprint against the one the adapter recorded, folds the adapter in
#   (`model.layers.lora.merge_lora`), and writes a checkpoint with `model.checkpoint.save_model` in
#   the base config's storage formats: touched modules stored in bf16 are rounded once from the fp32
#   merge; touched modules stored quantized (NVFP4 / MXFP8 / FP8, and NVFP4 routed experts) are
#   re-quantized from the fp32 merge with the project's one quantization function. It then loads
#   the written checkpoint again and reports, in export_report.json and on stdout, per touched
#   group the added error (||stored - exact|| / ||exact|| and relative to the adapter's own update
#   ||dW||), whether untouched tensors kept their values, and logits on a probe batch: how far the
#   adapter moves the base and how far the export lands from base + adapter.
#
# Why: the product's output is an adapter people can serve (vLLM `--lora-modules`, PEFT), or a
# single merged checkpoint for engines without LoRA support; a merged NVFP4 checkpoint loses part
# of the update to rounding, and the report says how much.
#
# Limits: `merged` holds the base in fp32 (quantized routed experts stay packed) plus fp32 copies of
# the touched linears, then loads the output once more to verify (`--no-verify` skips that).

REPORT_FILE = "export_report.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ExportError(RuntimeError):
    """The export could not be produced or did not verify."""


# ------------------------------------------------------------------------------ locating
def find_adapter(src: str | Path) -> Path:
    """SRC itself if it is an adapter directory, else the adapter below it with the highest step."""
    src = Path(src)
    if (src / CONFIG_FILE).exists():
        return src
    if not src.is_dir():
        raise ExportError(f"{src}: no such directory")
    found = [p.parent for p in src.rglob(CONFIG_FILE)]
    if not found:
        raise ExportError(f"{src}: no {CONFIG_FILE} in it or below it; give an adapter or run directory")

    def step(p: Path) -> tuple[int, float]:
        try:
            s = json.loads((p / METADATA_FILE).read_text()).get("step")
        except (OSError, json.JSONDecodeError):
            s = None
        return (s if isinstance(s, int) else -1, (p / WEIGHTS_FILE).stat().st_mtime)

    return max(found, key=step)


def _resolve_base(base: str | None, adapter_cfg_raw: dict) -> Path:
    path = base or adapter_cfg_raw.get("base_model_name_or_path")
    if not path or not Path(path).is_dir():
        raise ExportError(
            f"merged export needs the base checkpoint directory: pass --base (the adapter names "
            f"{adapter_cfg_raw.get('base_model_name_or_path')!r}, which is not a local directory)"
        )
    return Path(path)


def check_fits_base(cfg: LoRAConfig, tensors: dict[str, torch.Tensor], base: Path) -> None:
    """Build the base architecture on the meta device and load the adapter into it (shapes only)."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(ModelConfig.from_pretrained(base))
    try:
        apply_lora(model, cfg)
        load_lora_state_dict(model, tensors)
    except ValueError as e:
        raise ExportError(f"adapter does not fit base {base}: {e}") from e


# ------------------------------------------------------------------------------ peft
def model_card(cfg: LoRAConfig, raw: dict, meta: AdapterMetadata, tensors: dict[str, torch.Tensor]) -> str:
    n = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    base = raw.get("base_model_name_or_path") or "(not recorded)"
    metrics = (
        "\n".join(
            f"| {k} | {v:.4g} |" if isinstance(v, int | float) else f"| {k} | {v} |"
            for k, v in sorted(meta.metrics.items())
        )
        or "| (none) | |"
    )
    targets = ", ".join(cfg.target_modules) + (", routed experts (per expert)" if cfg.routed_experts else "")
    return f"""---
library_name: peft
base_model: {base}
tags: [lora, grpo, nvfp4]
---
# LoRA adapter for {base}

Trained with GRPO by this project (nvfp4-rl) on the frozen base as the engine serves it.

| field | value |
| --- | --- |
| base model | {base} |
| base fingerprint | {meta.base_fingerprint or "(not recorded)"} |
| rank r / alpha (scaling) | {cfg.r} / {cfg.alpha:g} ({cfg.scaling:g}) |
| target modules | {targets} |
| dropout | {cfg.dropout} |
| training step | {meta.step if meta.step is not None else "(not recorded)"} |
| parameters | {n:,} ({nbytes / 1e6:.1f} MB, {cfg.dtype}) |

## Metrics at export

| metric | value |
| --- | --- |
{metrics}

## Serving

- vLLM: `vllm serve {base} --enable-lora --max-lora-rank {cfg.r} --lora-modules adapter=<this directory>`
- PEFT: `PeftModel.from_pretrained(base_model, "<this directory>")` (module names are the
  checkpoint's: `self_attn.q_proj`, `mlp.gate_proj`, `block_sparse_moe.experts.{{e}}.w1`, ...)
- this project: `model.adapter.load_adapter(model, "<this directory>")`
"""


def export_peft(src: Path, out: Path, base: str | None = None) -> Path:
    cfg, tensors, meta = read_adapter(src)
    raw = json.loads((src / CONFIG_FILE).read_text())
    if base is not None:
        check_fits_base(cfg, tensors, Path(base))
    out.mkdir(parents=True, exist_ok=True)
    for fname in (CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE):
        if (src / fname).exists() and (src / fname).resolve() != (out / fname).resolve():
            shutil.copyfile(src / fname, out / fname)
    # The source verified (read_adapter above); a manifest of the copy catches damage in transit.
    write_manifest(out, [WEIGHTS_FILE])
    (out / "README.md").write_text(model_card(cfg, raw, meta, tensors))
    read_adapter(out)  # the copy parses back
    return out


# ------------------------------------------------------------------------------ merged
@dataclass
class GroupError:
    modules: int = 0
    exact_sq: float = 0.0
    delta_sq: float = 0.0
    error_sq: float = 0.0

    def summary(self) -> dict[str, float]:
        return {
            "modules": self.modules,
            "rel_error": math.sqrt(self.error_sq / max(self.exact_sq, 1e-30)),
            "error_over_delta": math.sqrt(self.error_sq / max(self.delta_sq, 1e-30)),
        }


@dataclass
class MergeReport:
    adapter: str
    base: str
    out: str
    groups: dict[str, dict[str, float]] = field(default_factory=dict)  # storage format -> error summary
    untouched_changed: list[str] = field(default_factory=list)  # tensors not bit-equal after re-save
    untouched_max_rel_change: float = 0.0  # max |reloaded - base| / max |base| over those tensors
    logits: dict[str, float] = field(default_factory=dict)
    verified: bool = False


def _probe_ids(cfg: ModelConfig, n_tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (1, n_tokens), generator=g)


def _rms(x: torch.Tensor) -> float:
    return x.float().square().mean().sqrt().item()


def _storage_format(cfg: ModelConfig, param_name: str) -> str:
    module = param_name.rpartition(".")[0]
    return cfg.module_dtype(module)


@torch.no_grad()
def export_merged(
    src: Path,
    out: Path,
    base: str | None = None,
    *,
    dtype: str = "bfloat16",
    verify: bool = True,
    probe_tokens: int = 32,
    device: str = "cpu",
) -> MergeReport:
    _, _, meta = read_adapter(src)
    base_dir = _resolve_base(base, json.loads((src / CONFIG_FILE).read_text()))
    fp = None
    if meta.base_fingerprint:  # in the dtype the learner held the base in: the fingerprint covers dtypes
        held = load_model(base_dir, device, dtype=_DTYPES.get(meta.base_dtype or "bfloat16", torch.bfloat16))
        fp = base_fingerprint(held)
        del held
    # Merge from an fp32 load: quantized non-expert weights dequantize exactly only in fp32 (NVFP4
    # values times an fp32 scale_2 are generally not bf16 numbers).
    model = load_model(base_dir, device, dtype=torch.float32)
    ids = _probe_ids(model.config, probe_tokens).to(device) if probe_tokens else None
    base_logits = model(ids) if ids is not None else None
    try:
        load_adapter(model, src, base_fingerprint=fp)
    except AdapterError as e:
        raise ExportError(str(e)) from e
    ref_logits = model(ids) if ids is not None else None

    cfg = model.config
    groups: dict[str, GroupError] = {}
    exact: dict[str, tuple[torch.Tensor, float]] = {}  # touched linear weight -> (fp32 W + dW, ||dW||^2)
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            delta = m.delta_weight()
            exact[f"{name}.weight"] = (m.weight.float() + delta, delta.square().sum().item())
    for key, st in merge_lora(model).items():  # routed experts: re-quantized inside the bank
        bank = model.get_submodule(key.rpartition(".")[0])
        g = groups.setdefault(f"routed_experts:{bank.fmt}", GroupError())
        g.modules += 1
        g.exact_sq += st.exact_sq
        g.delta_sq += st.delta_sq
        g.error_sq += st.error_sq

    # Float tensors whose storage is bf16 take the export dtype now; weights stored quantized stay fp32
    # so save_model quantizes the exact merge (one rounding), and the router stays fp32.
    out_dtype = _DTYPES[dtype]
    for name, p in model.named_parameters():
        stored_quantized = p.dim() == 2 and name.endswith(".weight") and _storage_format(cfg, name) != "bf16"
        if not stored_quantized and ".block_sparse_moe.gate." not in name:
            p.data = p.data.to(out_dtype)
    save_model(model, out)
    for fname in (CONFIG_FILE, METADATA_FILE):
        if (src / fname).exists():
            (out / "adapter").mkdir(exist_ok=True)
            shutil.copyfile(src / fname, out / "adapter" / fname)
    report = MergeReport(adapter=str(src), base=str(base_dir), out=str(out))
    if not verify:
        report.groups = {k: v.summary() for k, v in groups.items()}
        return _write_report(report, out)

    merged = load_model(out, device, dtype=torch.float32)
    held = dict(model.named_parameters())
    for name, p in merged.named_parameters():
        if name in exact:
            w_exact, delta_sq = exact[name]
            g = groups.setdefault(_storage_format(cfg, name), GroupError())
            g.modules += 1
            g.exact_sq += w_exact.square().sum().item()
            g.delta_sq += delta_sq
            g.error_sq += (p.float() - w_exact).square().sum().item()
        elif name in held and not torch.equal(p.float(), held[name].float()):
            # Re-saving re-quantizes unquantized-in-memory NVFP4 weights; their global scale can
            # drift by an ulp (amax recomputed from dequantized values). Reported, not hidden.
            report.untouched_changed.append(name)
            base_w = held[name].float()
            rel = ((p.float() - base_w).abs().max() / base_w.abs().max().clamp(min=1e-30)).item()
            report.untouched_max_rel_change = max(report.untouched_max_rel_change, rel)
    for (name, a), b in zip(_banks(merged), (bank for _, bank in _banks(model))):
        for buf, want in zip(a.buffers(recurse=False), b.buffers(recurse=False)):
            if not torch.equal(buf, want):
                raise ExportError(f"{out}: {name} does not hold the merged expert bits after reloading")
    report.groups = {k: v.summary() for k, v in groups.items()}
    if ids is not None:
        got = merged(ids)
        if not torch.isfinite(got).all():
            raise ExportError(f"{out}: the merged checkpoint gives non-finite logits")
        report.logits = {
            "adapter_effect_rms": _rms(ref_logits - base_logits),  # how far the adapter moves the base
            "export_error_rms": _rms(got - ref_logits),  # how far the export lands from base + adapter
            "export_error_max_abs": (got - ref_logits).abs().max().item(),
            "probe_tokens": probe_tokens,
        }
    report.verified = True
    return _write_report(report, out)


def _banks(model: torch.nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertBank)]


def _write_report(report: MergeReport, out: Path) -> MergeReport:
    (out / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2))
    return report


# ------------------------------------------------------------------------------ CLI
class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one `error:` line (usage is in --help)."""

    def error(self, message: str):
        self.exit(
            2, f"error: {message} (usage: {self.prog} SRC --out DIR [--format peft|merged]; see --help)\n"
        )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ... (cut)"


def main(argv: list[str] | None = None) -> int:
    ap = _OneLineParser(prog="python -m rl.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="adapter directory, or a run directory containing adapters")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--format", choices=("peft", "merged"), default="peft")
    ap.add_argument(
        "--base", help="base checkpoint directory (merged: required unless the adapter names one)"
    )
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="merged: dtype of tensors stored unquantized")  # fmt: skip
    ap.add_argument(
        "--probe-tokens", type=int, default=32, help="merged: tokens of the logits check (0: none)"
    )
    ap.add_argument("--no-verify", action="store_true", help="merged: do not reload the output to check it")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    try:
        src = find_adapter(args.src)
        out = Path(args.out)
        if args.format == "peft":
            export_peft(src, out, args.base)
            cfg, _, meta = read_adapter(out)
            print(
                f"exported adapter {src} -> {out} (r={cfg.r}, targets={cfg.target_modules}"
                + (", routed experts" if cfg.routed_experts else "")
                + (f", projector {cfg.projector_modules}" if cfg.projector_modules else "")
                + f", step={meta.step})"
            )
            return 0
        report = export_merged(
            src, out, args.base, dtype=args.dtype, verify=not args.no_verify,
            probe_tokens=args.probe_tokens, device=args.device,
        )  # fmt: skip
    except (ExportError, AdapterError, ValueError, OSError) as e:
        # ValueError: CheckpointError / IntegrityError / config errors of the base; OSError: paths
        # (--out is a file, no permission, a base directory without config.json).
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(f"merged {src} into {report.base} -> {out} (report: {out / REPORT_FILE})")
    for fmt, s in report.groups.items():
        print(f"  {fmt:>20}: {s['modules']} modules, added error {s['rel_error']:.3e} of the weights, "
              f"{s['error_over_delta']:.3f} x the adapter update")  # fmt: skip
    if report.logits:
        lg = report.logits
        print(f"  logits on {lg['probe_tokens']} probe tokens: adapter moves them "
              f"{lg['adapter_effect_rms']:.3e} RMS, export differs from base+adapter by "
              f"{lg['export_error_rms']:.3e} RMS")  # fmt: skip
    if report.untouched_changed:
        print(f"  warning: {len(report.untouched_changed)} untouched tensors changed on re-save (max "
              f"{report.untouched_max_rel_change:.1e} relative), "
              f"e.g. {report.untouched_changed[:3]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
