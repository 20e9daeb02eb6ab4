"""Prompt datasets for GRPO: DAPO-Math-17K, AIME, MATH-500, synthetic arithmetic, geo_vision, and a
resumable stream.

What: every dataset becomes `Prompt(uid, messages, ground_truth, data_source)` asking for a final
"Answer: ..." line; `PromptStream` serves batches in a per-epoch order that depends only on (seed,
epoch), with a cursor a checkpoint carries. The hub is tried first, then local parquet files, with a
logged message. Invariants: a resumed run sees exactly the prompts an uninterrupted one would; a bad
file or row fails with its path and key named.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

# Design notes (moved from the module docstring)
# What: every dataset becomes a list of `Prompt(uid, messages, ground_truth, data_source)` whose user
# message asks for a final line "Answer: <answer>" (scored by rl/rewards.py). Text datasets give a
# message `content` string; geo_vision gives a list of OpenAI-style content parts (image_url + text).
# `PromptStream` serves batches in a per-epoch shuffled order that depends only on (seed, epoch), with
# a cursor that `state_dict()` / `load_state_dict()` carry across a checkpoint, so a resumed run sees
# exactly the prompts an uninterrupted one would.
#
# Why this shape: records are typed dataclasses (they cross Ray actor boundaries); the hub is tried
# first as the recipes say, but offline machines fall back, with a logged message, to a local parquet:
# verl-style (columns data_source, prompt = [{role, content}], reward_model = {ground_truth, ...}), or
# for geo_vision the hub's own Geometry3K columns (images, problem, answer).
#
# Malformed rows never crash a run: a row that is not a mapping, has no usable user message (missing,
# wrong type, empty, not encodable as UTF-8, longer than `MAX_PROMPT_CHARS`), or no string ground
# truth is skipped and counted by reason (`SkipReason`); `build_datasets` attaches the counts to the
# stream (`PromptStream.skipped_rows`) and `skipped_row_metrics` turns them into `data/skipped_rows`
# metrics. Only a dataset left with no usable row is an error, and it names the reasons.
#
# Invariants: uids are stable across runs (derived from the problem text) and unique within a dataset
# (prompts are deduplicated by problem text); a batch never holds the same uid twice (an epoch's
# remainder smaller than a batch is skipped); arithmetic train and eval problems are disjoint for
# every seed (the split is a fixed hash of the problem, the seed only picks which problems).

log = logging.getLogger(__name__)

DAPO_HUB = "BytedTsinghua-SIA/DAPO-Math-17k"
# DAPO's prompt template (the DAPO-Math-17K hub rows carry it; the local copy has it stripped).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
REQUIRED_COLUMNS = ("prompt", "reward_model")
ArithOp = Literal["+", "-", "*"]
Split = Literal["train", "eval"]
# Arithmetic problems whose crc32 % EVAL_MODULUS == 0 form the eval split (10%).
EVAL_MODULUS = 10
_ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are enumerated, larger ones sampled
# A prompt longer than this (characters, before templating) is skipped before it is tokenized: real
# math problems are a few thousand characters at most, and tokenizing megabytes would stall loading.
MAX_PROMPT_CHARS = 1 << 16
MAX_ANSWER_CHARS = 1024  # mirrors common.scoring.MAX_TRUTH_CHARS: a longer reference could never be matched
GEO3K_HUB = "hiyouga/geometry3k"
MAX_IMAGE_PIXELS = 1 << 24  # 4096 x 4096: a guard against decompression bombs, far above any diagram
MAX_IMAGE_BYTES = 20 << 20  # encoded bytes of one image (model.vision's VisionConfig.max_image_bytes)
SkipReason = Literal[
    "not_a_mapping", "bad_prompt", "no_user_message", "empty_prompt", "prompt_too_long",
    "prompt_not_utf8", "missing_answer", "answer_not_string", "empty_answer", "answer_too_long",
    "prompt_too_many_tokens", "no_image", "too_many_images", "bad_image", "image_too_large",
    "image_marker_mismatch",
]  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """One prompt. `messages` is a chat ([{role, content}]), `content` a string or, for image prompts,
    a list of OpenAI-style parts ({"type": "text", ...}, {"type": "image_url", ...}); `ground_truth`
    the reference answer."""

    uid: str
    messages: list[dict[str, Any]] = field(hash=False)
    ground_truth: str
    data_source: str


def dapo_template(problem: str) -> str:
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"


def strip_dapo_template(content: str) -> str:
    """The bare problem of a user message, with DAPO's template removed if present."""
    text = content.strip()
    if text.startswith(DAPO_PREFIX.strip()):
        text = text[len(DAPO_PREFIX.strip()) :]
    if text.endswith(DAPO_SUFFIX.strip()):
        text = text[: -len(DAPO_SUFFIX.strip())]
    return text.strip()


def prompt_uid(source: str, problem: str) -> str:
    """Stable prompt id: the source and a hash of the problem text (or any dedup key)."""
    return f"{source}-{hashlib.sha1(problem.encode('utf-8')).hexdigest()[:16]}"


# --------------------------------------------------------------------------- verl-style rows
VERL_SCHEMA = "verl-style columns data_source, prompt = [{role, content}], reward_model = {ground_truth}"


def _check_columns(
    columns: Iterable[str], where: str, required: Sequence[str] = REQUIRED_COLUMNS, schema: str = VERL_SCHEMA
) -> None:
    columns = list(columns)
    missing = [c for c in required if c not in columns]
    if missing:
        raise ValueError(f"{where} is missing column {missing[0]!r} (needs {schema}); it has {columns}")


def answer_skip_reason(truth: Any) -> SkipReason | None:
    """Why a row's reference answer is unusable, or None: one rule for every dataset loader."""
    if truth is None:
        return "missing_answer"
    if not isinstance(truth, str):
        return "answer_not_string"
    if not truth.strip():
        return "empty_answer"
    if len(truth) > MAX_ANSWER_CHARS:
        return "answer_too_long"
    return None


def _row_problem_and_truth(row: Any, max_prompt_chars: int) -> tuple[str, str] | SkipReason:
    """(bare problem, ground truth) of a verl-style row, or why the row is unusable."""
    if not isinstance(row, Mapping):
        return "not_a_mapping"
    messages = row.get("prompt")
    if not isinstance(messages, list | tuple) or not all(isinstance(m, Mapping) for m in messages):
        return "bad_prompt"
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return "no_user_message"
    content = users[-1].get("content")
    if not isinstance(content, str):
        return "bad_prompt"
    if len(content) > max_prompt_chars:
        return "prompt_too_long"
    try:
        content.encode("utf-8")  # lone surrogates cannot be hashed into a uid nor tokenized
    except UnicodeEncodeError:
        return "prompt_not_utf8"
    problem = strip_dapo_template(content)
    if not problem:
        return "empty_prompt"
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    bad = answer_skip_reason(truth)
    return (problem, truth) if bad is None else bad


def records_from_rows(
    rows: Iterable[Any],
    default_source: str,
    uid_prefix: str,
    *,
    skipped: Counter | None = None,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
) -> list[Prompt]:
    """verl-style rows -> DAPO-templated `Prompt`s, deduplicated by problem text (first kept).
    The problem is the last user message, system messages (e.g. Qwen's \\boxed{} prompt) dropped.
    Malformed rows are skipped, counted by reason into `skipped` and summarised in one warning."""
    out, seen, bad = [], set(), Counter()
    n_rows = 0
    for row in rows:
        n_rows += 1
        parsed = _row_problem_and_truth(row, max_prompt_chars)
        if isinstance(parsed, str):
            bad[parsed] += 1
            continue
        problem, truth = parsed
        if problem in seen:
            continue
        seen.add(problem)
        messages = [{"role": "user", "content": dapo_template(problem)}]
        source = row.get("data_source")
        source = source if isinstance(source, str) and source else default_source
        out.append(Prompt(prompt_uid(uid_prefix, problem), messages, truth, source))
    log_skipped(uid_prefix, bad, n_rows, skipped)
    return out


def log_skipped(what: str, bad: Counter, n_rows: int, skipped: Counter | None) -> None:
    """One warning summarising the rows skipped by reason; the counts are added to `skipped`."""
    if bad:
        log.warning(
            "%s data: skipped %d of %d rows as malformed (%s)", what, sum(bad.values()), n_rows,
            ", ".join(f"{k}: {v}" for k, v in sorted(bad.items())),
        )  # fmt: skip
        if skipped is not None:
            skipped.update(bad)


def skipped_row_metrics(skipped: Mapping[str, int]) -> dict[str, float]:
    """`data/skipped_rows` (total) and `data/skipped_rows/<reason>` for the trainer's log."""
    return {"data/skipped_rows": float(sum(skipped.values())),
            **{f"data/skipped_rows/{k}": float(v) for k, v in sorted(skipped.items())}}  # fmt: skip


def read_parquet_rows(
    path: str | Path,
    required: Sequence[str] = REQUIRED_COLUMNS,
    schema: str = VERL_SCHEMA,
    key: str = "data.train_path / data.eval_path",
) -> list[dict[str, Any]]:
    """Rows of a parquet with the `required` columns (default: verl-style) plus data_source if it has
    one; a clear error names the file, the recipe `key` that points at it and a missing column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{key}: parquet file {str(path)!r} not found: set it to a parquet with "
            f"{schema} (copies of DAPO-Math-17K and AIME-2024 live in <repo>/../shared/data; geo_vision's "
            "is written by python -m common.geo_data --out data/geo_vision)"
        )
    try:
        names = pq.read_schema(path).names
        _check_columns(names, f"parquet {str(path)!r}", required, schema)
        columns = [c for c in ("data_source", *required) if c in names]
        return pq.read_table(path, columns=columns).to_pylist()
    except (pa.ArrowException, OSError) as e:  # truncated, flipped bytes, not a parquet at all
        raise ValueError(
            f"{key}: {str(path)!r} is not a readable parquet file ({type(e).__name__}: {e}). Fix: point "
            f"{key} at an intact parquet with {schema} (re-copy or re-download the file)"
        ) from None


def _load_rows(
    hub: str | None,
    path: str | Path | None,
    what: str,
    *,
    split: str = "train",
    required: Sequence[str] = REQUIRED_COLUMNS,
    schema: str = VERL_SCHEMA,
    key: str = "data.train_path",
) -> Iterable[Mapping[str, Any]]:
    """Rows from split `split` of the hub dataset `hub`, else from the local parquet `path` (the
    recipe's `key`, named in errors)."""
    if hub is not None:
        try:
            import datasets

            ds = datasets.load_dataset(hub, split=split)
            _check_columns(ds.column_names, f"hub dataset {hub!r}", required, schema)
            # Only the columns we read: the hub DAPO split has ~1.8M rows (its block repeated).
            ds = ds.select_columns([c for c in ("data_source", *required) if c in ds.column_names])
            if "images" in required:  # encoded bytes as in the parquet, not decoded PIL images
                ds = ds.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
            return ds
        except (ConnectionError, OSError) as e:  # datasets' offline / unreachable errors
            if path is None:
                raise FileNotFoundError(
                    f"{what}: the hub dataset {hub!r} is unreachable ({type(e).__name__}: {e}) and no local "
                    f"parquet was given; set the local path (data.train_path / data.eval_path)"
                ) from e
            log.warning(
                "%s: hub dataset %r unreachable (%s); falling back to the local parquet %s", what, hub,
                type(e).__name__, path,
            )  # fmt: skip
    if path is None:
        raise ValueError(f"{what}: give a hub dataset name or a local parquet path")
    return read_parquet_rows(path, required, schema, key)


def load_dapo_math(
    train_path: str | Path | None = None, hub: str | None = DAPO_HUB, skipped: Counter | None = None
) -> list[Prompt]:
    """DAPO-Math-17K: the hub dataset (which repeats its 17.9K unique rows ~100x), else the local
    parquet; deduplicated by problem text, each problem wrapped in DAPO's template.
    Tip: without network, HF_HUB_OFFLINE=1 skips the hub's ~20 s of retries."""
    return records_from_rows(
        _load_rows(hub, train_path, "DAPO-Math-17K"), "DAPO-17k", "dapo", skipped=skipped
    )


def load_aime_2024(
    path: str | Path | None = None, hub: str | None = None, skipped: Counter | None = None
) -> list[Prompt]:
    """AIME-2024 (verl-style rows), re-templated like the training prompts: the Qwen \\boxed{}
    system prompt is dropped and the problem wrapped in DAPO's "Answer:" template."""
    rows = _load_rows(hub, path, "AIME-2024", key="data.eval_path")
    return records_from_rows(rows, "aime_2024", "aime2024", skipped=skipped)


def load_geo_vision(
    path: str | Path | None = None,
    hub: str | None = GEO3K_HUB,
    split: str = "train",
    skipped: Counter | None = None,
    *,
    max_images: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> list[Prompt]:
    """A Geometry3K-format visual math dataset: split `split` of the hub dataset, else the local parquet
    (the shipped synthetic copy: data/geo_vision/{train,test}.parquet); image+text prompts (see
    common/geo_data.py for the message format). Rows with more than `max_images` images, or an image that
    does not decode or exceeds `max_image_pixels`, are skipped and counted into `skipped`."""
    from common import geo_data

    rows = _load_rows(
        hub, path, f"geo_vision ({split})", split=split, required=geo_data.GEO3K_COLUMNS,
        schema=geo_data.GEO3K_SCHEMA, key="data.train_path" if split == "train" else "data.eval_path",
    )  # fmt: skip
    return geo_data.records_from_geo3k_rows(
        rows, hub or "geo_vision", f"geo-{split}", skipped=skipped, max_images=max_images,
        max_image_pixels=max_image_pixels,
    )  # fmt: skip


# --------------------------------------------------------------------------- synthetic arithmetic
def _arith_answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _arith_text(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}"


def _arith_split(problem: str) -> Split:
    return "eval" if zlib.crc32(problem.encode()) % EVAL_MODULUS == 0 else "train"


def arithmetic_dataset(
    n: int,
    seed: int = 0,
    max_operand: int = 50,
    ops: Sequence[ArithOp] | str = ("+", "-"),
    split: Split = "train",
    digits: Sequence[int] | None = None,
) -> list[Prompt]:
    """`n` distinct problems "a<op>b=" with a, b in [0, max_operand] (ordered pairs: "-" may give a
    negative answer), ground truth str(answer); the expected completion is "Answer: <answer>".
    `digits` = (da, db) instead: a has exactly da digits and b exactly db (e.g. (3, 2): 123*45).
    Problems of `split` only (about 90% train / 10% eval, fixed by a hash of the problem text)."""
    ops = list(ops)
    bad = [op for op in ops if op not in ("+", "-", "*")]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of ['+', '-', '*'], got {ops}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if max_operand < 0 or n < 0:
        raise ValueError(f"need n >= 0 and max_operand >= 0, got n={n}, max_operand={max_operand}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    if digits is not None:
        if len(digits) != 2 or not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
            raise ValueError(f"digits must be two ints in [1, 9] (digits of a and of b), got {digits}")
        range_a, range_b = (range(10 ** (d - 1) if d > 1 else 0, 10**d) for d in digits)
    else:
        range_a = range_b = range(max_operand + 1)
    if len(ops) * len(range_a) * len(range_b) <= _ENUMERATE_LIMIT:
        pool = [(a, op, b) for op in ops for a in range_a for b in range_b]
        pool = [t for t in pool if _arith_split(_arith_text(*t)) == split]
        if n > len(pool):
            raise ValueError(
                f"asked for {n} {split} problems but only {len(pool)} exist with max_operand={max_operand} "
                f"and ops={ops}: raise max_operand, add ops, or lower the count"
            )
        chosen = [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]
    else:  # huge space: rejection-sample distinct problems (collisions are rare)
        chosen, seen = [], set()
        while len(chosen) < n:
            a, b = (r[int(rng.integers(len(r)))] for r in (range_a, range_b))
            t = (a, ops[int(rng.integers(len(ops)))], b)
            if t not in seen and _arith_split(_arith_text(*t)) == split:
                seen.add(t)
                chosen.append(t)
    return [
        Prompt(f"arith-{_arith_text(a, op, b)}", [{"role": "user", "content": f"{_arith_text(a, op, b)}="}],
               str(_arith_answer(a, op, b)), "arithmetic")
        for a, op, b in chosen
    ]  # fmt: skip


# --------------------------------------------------------------------------- the stream
class PromptStream:
    """Infinite batches of `batch_size` prompts; epoch e visits the records in the permutation drawn
    from (seed, e); the cursor (epoch, position) is the whole state."""

    def __init__(self, records: Sequence[Prompt], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(records) < batch_size:
            raise ValueError(f"the dataset has {len(records)} prompts, fewer than one batch of {batch_size}")
        self.records = list(records)
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation(0)
        # Rows dropped while building the datasets, by reason (filled by build_datasets; see
        # skipped_row_metrics). Not part of the cursor: the same data gives the same counts.
        self.skipped_rows: Counter = Counter()

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next_batch(self) -> list[Prompt]:
        if self.pos + self.batch_size > len(self.records):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.records[i] for i in idx]

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "batch_size": self.batch_size,
                "num_records": len(self.records)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key, mine in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("num_records", len(self.records)),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"data cursor was saved with {key}={state[key]} but this stream has {key}={mine}: "
                    "resume with the same data and seed as the checkpointed run"
                )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self.epoch)


def text_only(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with content-part lists reduced to their text parts (images dropped)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, Mapping) and part.get("type") == "text"
            )
        out.append({**m, "content": content})
    return out


def filter_prompt_length(
    records: Sequence[Prompt], tokenizer: Any, max_tokens: int, skipped: Counter | None = None
) -> list[Prompt]:
    """Drop prompts whose text is longer than `max_tokens` once chat-templated and tokenized (logged,
    and counted as `prompt_too_many_tokens` into `skipped`). Image parts are left out of the count:
    rendered as content-part lists they would count their base64 bytes (a 30 KB diagram = ~40K byte
    tokens, so every hub Geometry3K row would go); their token cost is bounded by the image limits
    (`data.max_images`, `data.max_image_pixels`) and checked against the model by the engine."""
    kept = [p for p in records if len(tokenizer.chat_prompt(text_only(p.messages))) <= max_tokens]
    if len(kept) < len(records):
        log.warning(
            "dropped %d of %d prompts longer than %d tokens",
            len(records) - len(kept),
            len(records),
            max_tokens,
        )
        if skipped is not None:
            skipped["prompt_too_many_tokens"] += len(records) - len(kept)
    return kept


def build_datasets(
    data: Any, *, seed: int, batch_size: int, tokenizer: Any = None
) -> tuple[PromptStream, list[Prompt]]:
    """(train stream, eval prompts) for an rl.config.DataSection. `data.seed` fixes which synthetic
    problems exist; `seed` (the trainer's) fixes the order they are served in. With a `tokenizer`,
    prompts over `data.max_prompt_tokens` tokens are dropped from both. Rows skipped from either
    split are counted in the stream's `skipped_rows`."""
    skipped: Counter = Counter()
    if data.kind == "arithmetic":
        common = {"seed": data.seed, "max_operand": data.max_operand, "ops": list(data.ops),
                  "digits": getattr(data, "digits", None)}  # fmt: skip
        train = arithmetic_dataset(data.num_train, split="train", **common)
        evals = arithmetic_dataset(data.num_eval, split="eval", **common)
    elif data.kind == "dapo_math":
        train = load_dapo_math(data.train_path, hub=data.hub_train, skipped=skipped)
        has_eval = data.eval_path is not None or data.hub_eval is not None
        evals = load_aime_2024(data.eval_path, hub=data.hub_eval, skipped=skipped) if has_eval else []
    elif data.kind == "geo_vision":
        limits = {"max_images": data.max_images, "max_image_pixels": data.max_image_pixels}
        train = load_geo_vision(data.train_path, data.hub_train, data.hub_train_split, skipped, **limits)
        has_eval = data.eval_path is not None or data.hub_eval is not None
        evals = (
            load_geo_vision(data.eval_path, data.hub_eval, data.hub_eval_split, skipped, **limits)
            if has_eval
            else []
        )
    else:
        raise ValueError(f"unknown data.kind {data.kind!r}; valid: arithmetic, dapo_math, geo_vision")
    if tokenizer is not None:
        train = filter_prompt_length(train, tokenizer, data.max_prompt_tokens, skipped)
        evals = filter_prompt_length(evals, tokenizer, data.max_prompt_tokens, skipped)
    if len(train) < batch_size and skipped:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
        raise ValueError(
            f"data: only {len(train)} usable training prompts (fewer than one batch of {batch_size}) after "
            f"skipping malformed rows ({reasons}); check data.train_path / data.hub_train and "
            "data.max_prompt_tokens"
        )
    stream = PromptStream(train, batch_size=batch_size, seed=seed)
    stream.skipped_rows = skipped
    return stream, evals
