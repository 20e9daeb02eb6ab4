"""KV-cache precision vs accuracy: next-token KL and top-1 agreement against a bf16 KV cache.

A `tiny` model trained here as a byte-level LM on DAPO-Math-17K problem texts (cached under
runs/_cache/kv-accuracy-lm; a random model's near-uniform distributions would say nothing) generates
greedily with a bf16 KV cache; the same tokens are teacher-forced through the engine's cached path
once per KV choice (fp8, nvfp4, nvfp4_4over6, per-layer overrides), and KL(bf16 || choice) and argmax
agreement are reported per choice and per position bucket. Checked first: the bf16 pass reproduces
the greedy tokens, and each cached path agrees with `forward(kv_sim=True)` (largest gap reported).

    python benchmarks/kv_accuracy.py --steps 300 --gen-tokens 512 --json OUT.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch

# Legend: S sequence, T scored tokens, V vocab.
# The model is trained on exact K/V (no KV simulation) and served from a quantized cache, the honest
# case; routed experts stay float, so only the cache's rounding differs between rows. Position
# buckets (early vs late) test the claim that FP4 K/V hurts long-range dependencies. K/V scales are
# the attention modules' defaults (DEFAULT_KV_SCALE = 1.0, uncalibrated), as the engine serves an
# uncalibrated checkpoint.

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.data import load_dapo_math, strip_dapo_template
from common.tokenizer import ByteTokenizer
from model.checkpoint import load_model, save_model
from model.config import ModelConfig, QuantConfig
from model.modeling import MiniMaxM3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / "runs" / "_cache" / "kv-accuracy-lm"
# The workspace layout puts shared/ beside the repository (../shared/data from the repo root).
DEFAULT_DATA = REPO.parent / "shared" / "data" / "dapo_math_17k.parquet"
INFO_FILE = "kv_accuracy_lm.json"
NUM_HELD_OUT = 64  # last problems of the file: prompts come from here, training never sees them
# Position buckets [lo, hi) of the predicting token; training windows are TRAIN_SEQ_LEN long.
BUCKETS = ((0, 128), (128, 256), (256, 384), (384, 1 << 30))


# ---------------------------------------------------------------------------- KV choices
@dataclasses.dataclass(frozen=True)
class KVChoice:
    """One cache configuration: main K/V dtype, per-layer overrides, index-key dtype."""

    name: str
    kv_cache_dtype: str  # a config CacheDtype, or "fp32": exact K/V and index keys (no rounding)
    index_cache_dtype: str = "bf16"
    overrides: tuple[tuple[int, str], ...] = ()

    @property
    def is_exact(self) -> bool:
        return self.kv_cache_dtype == "fp32"

    def config(self, base: ModelConfig) -> ModelConfig:
        if self.is_exact:  # the config has no fp32 cache dtype: the cache is built with dtype="fp32"
            return base
        return dataclasses.replace(
            base,
            kv_cache_dtype=self.kv_cache_dtype,
            index_cache_dtype=self.index_cache_dtype,
            kv_cache_dtype_overrides=dict(self.overrides),
        )


REFERENCE = KVChoice("bf16", "bf16")


def default_choices(num_layers: int) -> list[KVChoice]:
    """fp32 (the floor: what bf16 itself costs), whole-cache fp8 / nvfp4 / nvfp4_4over6, then
    per-layer overrides: which layer's K/V tolerates FP4, and the index cache's share."""
    rest = range(1, num_layers)
    out = [
        KVChoice("fp32 (floor)", "fp32", "fp32"),
        KVChoice("fp8", "fp8"),
        KVChoice("fp8 + fp8 index", "fp8", "fp8"),
        KVChoice("nvfp4 (index bf16)", "nvfp4"),
        KVChoice("nvfp4 + nvfp4 index", "nvfp4", "nvfp4"),
        KVChoice("nvfp4_4over6 (index bf16)", "nvfp4_4over6"),
        KVChoice("nvfp4_4over6 + 4over6 index", "nvfp4_4over6", "nvfp4_4over6"),
        KVChoice("layer 0 bf16, rest nvfp4", "nvfp4", overrides=((0, "bf16"),)),
        KVChoice("layer 0 fp8, rest nvfp4", "nvfp4", overrides=((0, "fp8"),)),
        KVChoice("layer 0 bf16, rest 4over6", "nvfp4_4over6", overrides=((0, "bf16"),)),
    ]
    out += [KVChoice(f"only layer {i} nvfp4", "bf16", overrides=((i, "nvfp4"),)) for i in (0, *rest)]
    return out


def with_kv_choice(model: MiniMaxM3ForCausalLM, choice: KVChoice) -> MiniMaxM3ForCausalLM:
    """A copy of `model` (same weights, same K/V scales) whose config carries `choice`, so that
    `forward(kv_sim=True)` and `new_kv_cache` both use it."""
    out = MiniMaxM3ForCausalLM(choice.config(model.config))
    out.load_state_dict(model.state_dict())
    for src, dst in zip(model.model.layers, out.model.layers, strict=True):
        for a, b in zip(src.self_attn.kv_scales(), dst.self_attn.kv_scales(), strict=True):
            b.copy_(a)
    return out.to(model.lm_head.weight.dtype).eval()


# ---------------------------------------------------------------------------- teacher forcing
@torch.inference_mode()
def cached_logprobs(
    model: MiniMaxM3ForCausalLM, seqs: list[list[int]], is_exact: bool = False
) -> list[torch.Tensor]:
    """Log-softmax [S, V] of every position of each sequence through the paged-cache path: one
    prefill of the whole sequence into a fresh cache of the model's configured dtypes (fp32 pages
    when `is_exact`). Each token's K/V is rounded on its own at append, so a prefill stores the
    same pages as decoding token by token would."""
    out = []
    page = model.config.index_block_size
    for ids in seqs:
        S = len(ids)
        n_pages = -(-S // page)
        exact = {"dtype": "fp32", "index_dtype": "fp32"} if is_exact else {}
        cache = model.new_kv_cache(n_pages, **exact)
        logits_SV = model.forward_cached(
            torch.tensor(ids),
            torch.arange(S),
            torch.zeros(S, dtype=torch.long),
            cache,
            torch.arange(n_pages)[None],
            torch.tensor([S]),
        )
        out.append(torch.log_softmax(logits_SV.float(), dim=-1))
    return out


@torch.inference_mode()
def simulated_logprobs(
    model: MiniMaxM3ForCausalLM, seqs: list[list[int]], is_exact: bool = False
) -> list[torch.Tensor]:
    """Same as `cached_logprobs` through the training forward with KV simulation (none when
    `is_exact`); one padded batch, padding after each sequence, so causal rows are unaffected."""
    S = max(len(s) for s in seqs)
    ids_BS = torch.zeros(len(seqs), S, dtype=torch.long)
    seq_ids_BS = torch.full((len(seqs), S), -1, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BS[b, : len(s)] = torch.tensor(s)
        seq_ids_BS[b, : len(s)] = 0
    positions_BS = torch.arange(S).expand(len(seqs), S)
    logits_BSV = model(ids_BS, positions_BS, seq_ids_BS, kv_sim=not is_exact)
    return [torch.log_softmax(logits_BSV[b, : len(s)], dim=-1) for b, s in enumerate(seqs)]


def next_token_metrics(ref_logp_TV: torch.Tensor, var_logp_TV: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per token: KL(ref || var) in nats (fp64 sum, clamped at 0 against rounding) and whether the
    two distributions' argmax agree. Inputs are log-probabilities [T, V]."""
    ref64, var64 = ref_logp_TV.double(), var_logp_TV.double()
    kl_T = (ref64.exp() * (ref64 - var64)).sum(-1).clamp_min(0.0)
    agree_T = ref_logp_TV.argmax(-1) == var_logp_TV.argmax(-1)
    return {"kl": kl_T, "agree": agree_T}


def summarize(kl_T: torch.Tensor, agree_T: torch.Tensor, positions_T: torch.Tensor) -> dict:
    """Mean / p99 KL and top-1 agreement, overall and per position bucket (BUCKETS)."""

    def stats(mask_T: torch.Tensor) -> dict:
        n = int(mask_T.sum())
        if n == 0:
            return {"n": 0}
        kl = kl_T[mask_T]
        return {
            "n": n,
            "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)),
            "kl_max": float(kl.max()),
            "top1_agree": float(agree_T[mask_T].double().mean()),
        }

    out = stats(torch.ones_like(agree_T))
    out["buckets"] = {
        f"{lo}-{hi - 1 if hi < 1 << 30 else ''}": stats((positions_T >= lo) & (positions_T < hi))
        for lo, hi in BUCKETS
    }
    return out


def compare(
    ref: list[torch.Tensor], var: list[torch.Tensor], score_from: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl_T, agree_T, positions_T) over the scored positions: position p of sequence i (whose
    log-probs predict token p + 1) is scored when score_from[i] <= p < S - 1."""
    kls, agrees, positions = [], [], []
    for r, v, s0 in zip(ref, var, score_from, strict=True):
        m = next_token_metrics(r[s0:-1], v[s0:-1])
        kls.append(m["kl"])
        agrees.append(m["agree"])
        positions.append(torch.arange(s0, r.shape[0] - 1))
    return torch.cat(kls), torch.cat(agrees), torch.cat(positions)


# ---------------------------------------------------------------------------- trained model
def _problems(data: Path) -> list[str]:
    return [strip_dapo_template(p.messages[-1]["content"]) for p in load_dapo_math(data, hub=None)]


def train_lm(
    out: Path, data: Path, steps: int, seq_len: int = 256, batch: int = 8, lr: float = 3e-3, seed: int = 0
) -> dict:
    """Train the `tiny` preset (float experts, exact K/V) as a byte LM on random windows of the
    DAPO problem stream; save it atomically to `out` with its training record."""
    torch.manual_seed(seed)
    tok = ByteTokenizer()
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig())
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=seed)
    model.requires_grad_(True).train()
    stream: list[int] = []
    for text in _problems(data)[:-NUM_HELD_OUT]:
        stream += [*tok.encode(text), tok.eos_token_id]
    stream_T = torch.tensor(stream)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps)
    )
    gen = torch.Generator().manual_seed(seed)
    t0, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        start_B = torch.randint(len(stream) - seq_len - 1, (batch,), generator=gen)
        win_BS = stream_T[start_B[:, None] + torch.arange(seq_len + 1)]
        logp_BS, _ = model.token_logprobs(win_BS[:, :-1], win_BS[:, 1:])
        loss = -logp_BS.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # SYNC: logging, once per step of a one-off build
        if step % 25 == 0 or step == steps:
            recent = sum(losses[-25:]) / len(losses[-25:])
            print(f"  train step {step}/{steps}: loss {recent:.3f} nats/byte", flush=True)
    info = {
        "steps": steps, "seq_len": seq_len, "batch": batch, "lr": lr, "seed": seed,
        "final_loss": sum(losses[-25:]) / len(losses[-25:]), "seconds": time.perf_counter() - t0,
        "corpus_tokens": len(stream),
    }  # fmt: skip
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_model(model.requires_grad_(False).eval(), staging)
    (staging / INFO_FILE).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)  # the cache appears whole or not at all
    return info


def ensure_lm(path: Path, data: Path, steps: int) -> tuple[MiniMaxM3ForCausalLM, dict]:
    """The cached trained model (fp32), rebuilt when absent or trained for a different --steps."""
    info_file = path / INFO_FILE
    info = json.loads(info_file.read_text()) if info_file.exists() else None
    if info is None or info["steps"] != steps:
        print(f"training the byte LM ({steps} steps) into {path} (once; cached afterwards)", flush=True)
        info = train_lm(path, data, steps)
    return load_model(path, dtype=torch.float32).eval(), info


# ---------------------------------------------------------------------------- generation
@torch.inference_mode()
def generate_reference(
    model: MiniMaxM3ForCausalLM, prompts: list[list[int]], gen_tokens: int, temperature: float = 0.0
) -> list[list[int]]:
    """Continuations (greedy by default; seeded samples at `temperature` > 0) with the native
    engine over a bf16 KV cache, eos ignored so every sequence runs the full length. Returns
    prompt + generated ids."""
    from rollout.engine import Request, SamplingParams
    from rollout.native.engine import NativeEngine

    page = model.config.index_block_size
    longest = max(len(p) for p in prompts) + gen_tokens
    engine = NativeEngine(
        model,
        max_pages=len(prompts) * (-(-longest // page) + 1),
        max_batch_tokens=4096,
        max_num_seqs=len(prompts),
        kv_dtype="bf16",
        index_dtype="bf16",
    )
    params = SamplingParams(temperature=temperature, max_tokens=gen_tokens, ignore_eos=True)
    reqs = [Request(tuple(p), params, seed=i, request_id=str(i)) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    return [[*p, *c.token_ids] for p, c in zip(prompts, outs, strict=True)]


# ---------------------------------------------------------------------------- driver
def measure(
    model: MiniMaxM3ForCausalLM, seqs: list[list[int]], score_from: list[int], choices: list[KVChoice]
) -> list[dict]:
    """One record per choice: summary against the bf16 cache plus the path-agreement check."""
    ref = cached_logprobs(with_kv_choice(model, REFERENCE), seqs)
    gen_match = torch.cat([r[s0:-1].argmax(-1) == torch.tensor(s[s0 + 1 :])
                           for r, s, s0 in zip(ref, seqs, score_from, strict=True)])  # fmt: skip
    records = []
    for choice in choices:
        t0 = time.perf_counter()
        variant = with_kv_choice(model, choice)
        var = cached_logprobs(variant, seqs, choice.is_exact)
        sim = simulated_logprobs(variant, seqs, choice.is_exact)
        kl_T, agree_T, pos_T = compare(ref, var, score_from)
        path_kl_T, _, _ = compare(var, sim, score_from)
        path_diff_T = torch.cat(
            [(a - b)[s0:-1].abs().amax(-1) for a, b, s0 in zip(var, sim, score_from, strict=True)]
        )
        cache = variant.new_kv_cache(
            1, **({"dtype": "fp32", "index_dtype": "fp32"} if choice.is_exact else {})
        )
        records.append({
            "choice": choice.name,
            "kv_cache_dtype": choice.kv_cache_dtype,
            "index_cache_dtype": choice.index_cache_dtype,
            "overrides": {str(k): v for k, v in choice.overrides},
            "kv_bytes_per_token": cache.total_bytes_per_token(),
            **summarize(kl_T, agree_T, pos_T),
            # The two paths compute K/V with differently shaped fp32 matmuls: a one-ulp difference
            # can flip a quantizer rounding (fp8 / e2m1 code, the 4-over-6 pick) or an MSA block
            # choice, so a few positions differ visibly; the rest agree to fp32 noise.
            "path_kl_mean": float(path_kl_T.mean()),
            "path_frac_positions_over_1e-3": float((path_diff_T > 1e-3).double().mean()),
            "path_max_abs_logprob_diff": float(path_diff_T.max()),
            "ref_greedy_reproduced": float(gen_match.double().mean()),
            "seconds": time.perf_counter() - t0,
        })  # fmt: skip
    return records


def _fmt_table(records: list[dict]) -> str:
    fp8 = next((r["kl_mean"] for r in records if r["choice"] == "fp8"), None)
    bucket_keys = list(records[0]["buckets"])
    early, late = bucket_keys[0], bucket_keys[-1]
    head = ["KV choice", "bytes/tok", "mean KL", "p99 KL", "KL / fp8", "top-1 agree",
            f"KL pos {early}", f"KL pos {late}", f"agree {early}", f"agree {late}"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        e, la = r["buckets"][early], r["buckets"][late]
        cells = [
            r["choice"],
            str(r["kv_bytes_per_token"]),
            f"{r['kl_mean']:.2e}",
            f"{r['kl_p99']:.2e}",
            f"{r['kl_mean'] / fp8:.2f}x" if fp8 else "-",
            f"{r['top1_agree']:.4f}",
            *(f"{b['kl_mean']:.2e}" if b["n"] else "-" for b in (e, la)),
            *(f"{b['top1_agree']:.4f}" if b["n"] else "-" for b in (e, la)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps of the cached byte LM")
    ap.add_argument("--gen-tokens", type=int, default=512, help="greedy tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy reference generations")
    ap.add_argument("--prompt-bytes", type=int, default=64, help="prompt = first bytes of a held-out problem")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--json", type=Path, default=None, help="write one JSON line per KV choice here")
    args = ap.parse_args(argv)
    if args.prompts > NUM_HELD_OUT:
        ap.error(f"--prompts must be <= {NUM_HELD_OUT}")
    t0 = time.perf_counter()
    model, info = ensure_lm(args.cache_dir, args.data, args.steps)
    print(f"model: tiny preset, {info['steps']} steps, final train loss {info['final_loss']:.3f} nats/byte")
    tok = ByteTokenizer()
    held_out = _problems(args.data)[-NUM_HELD_OUT:]
    prompts = [tok.encode(p)[: args.prompt_bytes + 1] for p in held_out[: args.prompts]]
    seqs = generate_reference(model, prompts, args.gen_tokens, args.temperature)
    how = "greedy" if args.temperature == 0 else f"T={args.temperature}"
    print(f"generated {len(seqs)} x {args.gen_tokens} {how} tokens (bf16 KV); sample continuation:")
    print("  " + repr(tok.decode(seqs[0][len(prompts[0]) :])[:300]))
    score_from = [len(p) - 1 for p in prompts]  # the predictions of generated tokens only
    records = measure(model, seqs, score_from, default_choices(model.config.num_hidden_layers))
    meta = {
        "train": info,
        "prompts": args.prompts,
        "gen_tokens": args.gen_tokens,
        "prompt_bytes": args.prompt_bytes,
        "temperature": args.temperature,
        "reference": f"bf16 KV + bf16 index cache, engine {how}",
    }
    print(_fmt_table(records))
    print("cached path vs forward(kv_sim=True) of the same choice: mean KL between the paths (vs the")
    print("choice's KL to bf16), share of positions where a log-prob differs by > 1e-3, max |diff|:")
    for r in records:
        print(f"  {r['choice']:30s} {r['path_kl_mean']:.1e} (vs {r['kl_mean']:.1e})  "
              f"{r['path_frac_positions_over_1e-3']:.4f}  {r['path_max_abs_logprob_diff']:.1e}")  # fmt: skip
    reproduced = records[0]["ref_greedy_reproduced"]
    print(f"bf16 teacher-forced argmax = the engine's sampled token at {reproduced:.4f} of positions")
    print(f"total {time.perf_counter() - t0:.0f}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("w") as f:
            for r in records:
                f.write(json.dumps({**r, **meta}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
