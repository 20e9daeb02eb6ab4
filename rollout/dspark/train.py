"""Drafter training by distillation from the target, and the cached drafter of the quickstart's tiny model.

    python -m rollout.dspark.train --target runs/_cache/quickstart-base --data arithmetic --out DIR
    python -m rollout.dspark.train --target CKPT --adapter ADAPTER_DIR \\
        --data ../shared/data/dapo_math_17k.parquet --out DIR

The target completes the prompts itself through the native engine (so the drafter learns the
distribution it is checked against), one target pass per batch captures the hidden states the
drafter reads, and `distill_loss` is DSpark's (docs/FACTS.md, "DSpark speculative decoding"). Output:
`OUT/dspark/{config.json, model.safetensors}` with the target's fingerprint and the training summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from rollout.dspark.cache import target_hidden
from rollout.dspark.model import DSPARK_DIR, Drafter, DSparkConfig, load_drafter, save_drafter

# Legend: B sequences, S length, A anchors per sequence, N block size, L*D captured width, V vocab.
#
# Data: prompts (arithmetic, or a verl-style parquet) completed with `samples_per_prompt` samples at
# `temperature` plus one greedy completion each, the target on its own cache numerics (NVFP4 KV ->
# the forward's KV simulation). Features: the residual stream after `target_layer_ids` and the final
# hidden state (p = softmax(lm_head(h)) at T = 1), stored once for all epochs. Loss: A random anchors
# per sequence in the completion; block k = 1..N teacher-forced through the Markov head; per position
# 0.1 * CE(data token) + 0.9 * TV(q_k, p_k) + 1.0 * BCE(c_k, 1 - TV(q_k, p_k)) (TV = half the L1
# distance, the rejection probability), weighted exp(-(k - 1) / 4). Logged accepted-length estimates
# on held-out sequences, teacher-forced with verify length N: greedy
# 1 + sum_k prod_{i<=k} [argmax q_i == argmax p_i], sampled 1 + sum_k prod_{i<=k} (1 - TV_i).

QUICKSTART_BASE = "runs/_cache/quickstart-base"
QUICKSTART_DRAFTER = "runs/_cache/quickstart-dspark"


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 32
    anchors_per_seq: int = 4
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    num_prompts: int = 768
    samples_per_prompt: int = 1  # at `temperature`, plus one greedy completion per prompt
    temperature: float = 1.0
    max_tokens: int = 16
    max_prompt_tokens: int = 256
    num_eval_seqs: int = 64
    log_every: int = 100
    seed: int = 0
    time_budget_s: float | None = None  # stop early (after a logged eval) once exceeded
    drafter: dict = field(default_factory=dict)  # DSparkConfig overrides (block_size, num_layers, ...)

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq", "num_prompts", "max_tokens", "log_every"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not (self.lr > 0 and self.temperature >= 0 and self.samples_per_prompt >= 0):
            raise ValueError("TrainConfig needs lr > 0, temperature >= 0, samples_per_prompt >= 0")


# --------------------------------------------------------------------------- data
@torch.no_grad()
def generate_sequences(
    target: torch.nn.Module, prompts: list[list[int]], cfg: TrainConfig, stop_token_ids: tuple[int, ...] = ()
) -> list[tuple[list[int], int]]:
    """(prompt + completion ids, prompt length) from the target itself, via the native engine."""
    from rollout.engine import Request, SamplingParams
    from rollout.native.engine import NativeEngine

    page = target.config.index_block_size
    longest = max(len(p) for p in prompts) + cfg.max_tokens
    pages = 256 * (-(-longest // page))
    engine = NativeEngine(target, max_pages=pages, max_batch_tokens=8192, max_num_seqs=256, seed=cfg.seed)
    reqs = [Request(tuple(p), SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens,
                                             stop_token_ids=stop_token_ids)) for p in prompts]  # fmt: skip
    if cfg.samples_per_prompt:
        sp = SamplingParams(
            temperature=cfg.temperature, max_tokens=cfg.max_tokens, stop_token_ids=stop_token_ids
        )
        reqs += [
            Request(tuple(p), sp, n=cfg.samples_per_prompt, seed=cfg.seed + 1000 * i)
            for i, p in enumerate(prompts)
        ]
    out = []
    for start in range(0, len(reqs), 256):
        for c in engine.generate(reqs[start : start + 256]):
            out.append((list(c.prompt_token_ids) + c.token_ids, len(c.prompt_token_ids)))
    return out


@dataclass
class Features:
    """Padded training tensors of B sequences (target pass done once)."""

    ids_BS: torch.Tensor  # int64, 0-padded
    lens_B: torch.Tensor  # int64
    prompt_lens_B: torch.Tensor  # int64
    captured_BSX: torch.Tensor  # target layers' outputs, the drafter's dtype
    final_BSD: torch.Tensor  # target's final-norm hidden (its next-token distribution through lm_head)

    def __len__(self) -> int:
        return self.ids_BS.shape[0]

    def select(self, idx: torch.Tensor) -> Features:
        return Features(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


@torch.no_grad()
def build_features(
    target: torch.nn.Module, seqs: list[tuple[list[int], int]], layer_ids: list[int], dtype: torch.dtype,
    batch: int = 64,
) -> Features:  # fmt: skip
    cfg = target.config
    kv_sim = cfg.kv_cache_dtype != "bf16" or cfg.index_cache_dtype != "bf16"
    dev = target.lm_head.weight.device
    S = max(len(s) for s, _ in seqs)
    ids_BS = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, (s, _) in enumerate(seqs):
        ids_BS[b, : len(s)] = torch.tensor(s)
    ids_BS = ids_BS.to(dev)
    caps, finals = [], []
    for start in range(0, len(seqs), batch):
        cap, fin = target_hidden(target, layer_ids, ids_BS[start : start + batch], kv_sim=kv_sim)
        caps.append(cap.to(dtype))
        finals.append(fin)
    lens = torch.tensor([len(s) for s, _ in seqs], device=dev)
    plens = torch.tensor([p for _, p in seqs], device=dev)
    return Features(ids_BS, lens, plens, torch.cat(caps), torch.cat(finals))


def sample_anchors(f: Features, A: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A anchors per sequence, uniform over completion positions [prompt_len, len - 2] (the anchor
    is a generated token and at least one token follows): (anchors [B, A], valid [B, A])."""
    lo_B = f.prompt_lens_B
    span_B = (f.lens_B - 1 - lo_B).clamp(min=0)  # number of valid anchors
    u_BA = torch.rand(len(f), A, generator=gen).to(lo_B.device)
    anchors_BA = lo_B[:, None] + (u_BA * span_B[:, None]).long()
    return anchors_BA.clamp(max=f.ids_BS.shape[1] - 1), (span_B > 0)[:, None].expand(-1, A)


def block_outputs(drafter: Drafter, f: Features, anchors_BA: torch.Tensor) -> dict[str, torch.Tensor]:
    """Teacher-forced drafter outputs and target distributions for the blocks at `anchors_BA`."""
    N = drafter.config.block_size
    B, S = f.ids_BS.shape
    dev = f.ids_BS.device
    pos_S = torch.arange(S, device=dev)
    ctx_kv_BSL2GC = drafter.context_kv(f.captured_BSX, pos_S.expand(B, S))
    ctx_allowed_BAS = pos_S[None, None, :] < anchors_BA[..., None]
    anchor_ids_BA = f.ids_BS.gather(1, anchors_BA)
    h_BAND = drafter.block_hidden(anchor_ids_BA, anchors_BA, ctx_kv_BSL2GC, ctx_allowed_BAS)
    k_N = torch.arange(N, device=dev)
    src_BAN = (anchors_BA[..., None] + k_N).clamp(max=S - 1)  # position whose next token is drafted
    valid_BAN = (anchors_BA[..., None] + k_N + 1) < f.lens_B[:, None, None]
    prev_BAN = f.ids_BS.gather(1, src_BAN.flatten(1)).view_as(src_BAN)
    next_BAN = f.ids_BS.gather(1, (src_BAN + 1).clamp(max=S - 1).flatten(1)).view_as(src_BAN)
    logits_BANV, e_BANR = drafter.markov_logits(drafter.base_logits(h_BAND), prev_BAN)
    final_BAND = f.final_BSD.gather(1, src_BAN.flatten(1)[..., None].expand(-1, -1, f.final_BSD.shape[-1]))
    with torch.no_grad():
        p_BANV = torch.softmax(drafter.base_logits(final_BAND.view(*src_BAN.shape, -1)), dim=-1)
    conf_BAN = drafter.confidence_logit(h_BAND, e_BANR)
    return dict(logits=logits_BANV, p=p_BANV, next=next_BAN, valid=valid_BAN, conf_logit=conf_BAN)


def distill_loss(
    drafter: Drafter, f: Features, anchors_BA: torch.Tensor, valid_BA: torch.Tensor, focus: float = 0.0
):
    """0.1 CE + 0.9 TV + 1.0 confidence BCE, position weights exp(-(k-1)/4) -> (loss, metrics).
    `focus` > 0 also weights each position by (its TV / the batch's mean TV) ** focus (no gradient
    through the weight): the positions where verification would reject the draft count more."""
    o = block_outputs(drafter, f, anchors_BA)
    N = drafter.config.block_size
    logq_BANV = torch.log_softmax(o["logits"], dim=-1)
    tv_BAN = 0.5 * (logq_BANV.exp() - o["p"]).abs().sum(-1)
    ce_BAN = -logq_BANV.gather(-1, o["next"][..., None])[..., 0]
    bce_BAN = F.binary_cross_entropy_with_logits(o["conf_logit"], (1 - tv_BAN).detach(), reduction="none")
    w_N = torch.exp(-torch.arange(N, device=tv_BAN.device, dtype=torch.float32) / 4)
    w_BAN = w_N * (o["valid"] & valid_BA[..., None]).float()
    if focus > 0:
        tv_d = tv_BAN.detach()
        mean_tv = (tv_d * w_BAN).sum() / w_BAN.sum().clamp(min=1.0)
        w_BAN = w_BAN * (tv_d / mean_tv.clamp(min=1e-6)) ** focus
    denom = w_BAN.sum().clamp(min=1.0)
    ce, tv, bce = ((x * w_BAN).sum() / denom for x in (ce_BAN, tv_BAN, bce_BAN))
    loss = 0.1 * ce + 0.9 * tv + 1.0 * bce
    return loss, {"loss": loss.detach(), "ce": ce.detach(), "tv": tv.detach(), "bce": bce.detach()}


@torch.no_grad()
def estimate_accept_len(
    drafter: Drafter, f: Features, gen: torch.Generator, anchors_per_seq: int = 4
) -> dict:
    """Teacher-forced tokens per verification step (notes at the top of the module), greedy and sampled."""
    anchors_BA, valid_BA = sample_anchors(f, anchors_per_seq, gen)
    o = block_outputs(drafter, f, anchors_BA)
    q_BANV = torch.softmax(o["logits"], dim=-1)
    ok_BAN = (o["logits"].argmax(-1) == o["p"].argmax(-1)).float()
    alpha_BAN = 1 - 0.5 * (q_BANV - o["p"]).abs().sum(-1)
    # Past a sequence's end nothing more is emitted: treat those positions as rejected.
    ok_BAN, alpha_BAN = ok_BAN * o["valid"], alpha_BAN * o["valid"]
    keep = valid_BA.flatten()

    def tokens(a_BAN):
        return float((1 + a_BAN.cumprod(-1).sum(-1)).flatten()[keep].mean())

    conf = torch.sigmoid(o["conf_logit"]).cumprod(-1)
    predicted = float((1 + (conf * o["valid"]).sum(-1)).flatten()[keep].mean())
    return {"accept_len_greedy": tokens(ok_BAN), "accept_len_sampled": tokens(alpha_BAN),
            "accept_len_confidence": predicted}  # fmt: skip


# --------------------------------------------------------------------------- training
def train_drafter(
    target: torch.nn.Module, seqs: list[tuple[list[int], int]], cfg: TrainConfig, log=print
) -> tuple[Drafter, dict]:
    """A drafter for `target` trained on `seqs` (the last `num_eval_seqs` held out)."""
    torch.manual_seed(cfg.seed)
    dev = target.lm_head.weight.device
    target.eval().requires_grad_(False)
    dcfg = DSparkConfig.for_target(target.config, **cfg.drafter)
    dtype = torch.float32 if dcfg.dtype == "fp32" else torch.bfloat16
    drafter = Drafter(dcfg).init_weights(seed=cfg.seed).to(device=dev, dtype=dtype)
    drafter.bind(target).train()
    gen = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(seqs), generator=gen).tolist()
    n_eval = min(cfg.num_eval_seqs, len(seqs) // 5)
    t0 = time.perf_counter()
    feats = build_features(target, [seqs[i] for i in perm], dcfg.target_layer_ids, drafter.dtype)
    train_f = feats.select(torch.arange(n_eval, len(feats), device=dev))
    eval_f = feats.select(torch.arange(0, n_eval, device=dev))
    secs = time.perf_counter() - t0
    log(f"dspark: {len(train_f)} train / {len(eval_f)} eval sequences, target features in {secs:.1f}s")
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    history, est, t_train = [], {}, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(len(train_f), (cfg.batch_size,), generator=gen).to(dev)
        batch = train_f.select(idx)
        anchors_BA, valid_BA = sample_anchors(batch, cfg.anchors_per_seq, gen)
        loss, metrics = distill_loss(drafter, batch, anchors_BA, valid_BA)
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        over_time = cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s
        if step % cfg.log_every == 0 or step == cfg.steps or over_time:
            drafter.eval()
            est = (
                estimate_accept_len(drafter, eval_f, torch.Generator().manual_seed(1)) if len(eval_f) else {}
            )
            drafter.train()
            row = {"step": step, **{k: round(float(v), 4) for k, v in metrics.items()}, **est,
                   "seconds": round(time.perf_counter() - t_train, 1)}  # fmt: skip
            history.append(row)
            log(
                "dspark "
                + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )
            if over_time:
                log(f"dspark: time budget {cfg.time_budget_s}s reached at step {step}")
                break
    drafter.eval().requires_grad_(False)
    summary = {"history": history, "final": history[-1] if history else {}, "num_sequences": len(seqs)}
    return drafter, summary


def _fingerprint(target: torch.nn.Module) -> str:
    from model.checkpoint import base_fingerprint

    return base_fingerprint(target)


def arithmetic_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token ids of `n` quickstart training prompts (byte tokenizer, chat template)."""
    from common.data import arithmetic_dataset
    from common.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return [tok.chat_prompt(p.messages) for p in arithmetic_dataset(n, seed=seed)]


def parquet_prompts(path: str | Path, n: int, tokenizer, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of the first `n` prompts of a verl-style parquet (DAPO-templated), left-truncated."""
    from common.data import read_parquet_rows, records_from_rows

    records = records_from_rows(read_parquet_rows(path), "parquet", Path(path).stem)[:n]
    return [tokenizer.chat_prompt(p.messages)[-max_prompt_tokens:] for p in records]


def run(
    target: torch.nn.Module,
    prompts: list[list[int]],
    out: str | Path,
    cfg: TrainConfig,
    stop_ids=(),
    log=print,
):
    """Generate data with `target`, train, save under `out/dspark`; returns the summary."""
    t0 = time.perf_counter()
    seqs = generate_sequences(target, prompts, cfg, stop_ids)
    log(f"dspark: generated {len(seqs)} sequences in {time.perf_counter() - t0:.1f}s")
    drafter, summary = train_drafter(target, seqs, cfg, log)
    summary["target_fingerprint"] = _fingerprint(target)
    summary["train_config"] = dataclasses.asdict(cfg)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    drafter.config.metadata = summary
    save_drafter(drafter, out)
    log(f"dspark: saved {Path(out) / DSPARK_DIR} ({summary['seconds']}s)")
    return summary


def ensure_quickstart_drafter(
    base: str | Path = QUICKSTART_BASE, out: str | Path = QUICKSTART_DRAFTER, log=print
) -> Path:
    """The quickstart tiny model's drafter, trained once (a few CPU minutes) and cached at `out`;
    rebuilt if the cached one was trained for another base (fingerprint in its metadata)."""
    from common.tokenizer import ByteTokenizer
    from model.checkpoint import load_model
    from rollout.bases.warmup import ensure_base

    base, out = Path(ensure_base(base, log=log)), Path(out)
    target = load_model(base, dtype=torch.float32).eval()
    if (out / DSPARK_DIR).exists():
        meta = load_drafter(out).config.metadata
        if meta.get("target_fingerprint") == _fingerprint(target):
            return out
        log(f"dspark: cached drafter at {out} was trained for another base: retraining")
    log(f"dspark: training the quickstart drafter at {out} (once; cached afterwards)")
    cfg = TrainConfig(drafter={"block_size": 6}, time_budget_s=300.0)
    run(target, arithmetic_prompts(cfg.num_prompts), out, cfg, (ByteTokenizer.eos_token_id,), log)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout.dspark.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory applied to the target first")
    p.add_argument("--data", default="arithmetic", help="'arithmetic' or a verl-style parquet of prompts")
    p.add_argument("--out", required=True, help="the drafter is written to OUT/dspark/")
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--config", default="{}", help="JSON TrainConfig overrides, e.g. '{\"steps\": 300}'")
    args = p.parse_args(argv)
    from common.tokenizer import load_tokenizer
    from model.checkpoint import load_model

    cfg = TrainConfig(**json.loads(args.config))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    target = load_model(args.target, device=args.device, dtype=dtype).eval()
    if args.adapter:
        from model.adapter import load_adapter

        load_adapter(target, args.adapter)
    tok = load_tokenizer(args.tokenizer)
    if args.data == "arithmetic":
        prompts = arithmetic_prompts(cfg.num_prompts, cfg.seed)
    else:
        prompts = parquet_prompts(args.data, cfg.num_prompts, tok, cfg.max_prompt_tokens)
    run(target, prompts, args.out, cfg, tuple(tok.stop_token_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
