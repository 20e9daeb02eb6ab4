"""common/data.py (datasets, templates, resumable stream) and common/tokenizer.py on the shared parquets."""

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    Prompt,
    PromptStream,
    arithmetic_dataset,
    build_datasets,
    dapo_template,
    load_aime_2024,
    load_dapo_math,
    read_parquet_rows,
    records_from_rows,
    skipped_row_metrics,
)
from common.scoring import score_math_dapo
from common.tokenizer import ByteTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"  # the layout: <repo>/../shared/data
DAPO = SHARED_DATA / "dapo_math_17k.parquet"
AIME = SHARED_DATA / "aime_2024.parquet"
needs_dapo = pytest.mark.skipif(
    not DAPO.exists(), reason=f"real data not found at {DAPO} (<repo>/../shared/data)"
)
needs_aime = pytest.mark.skipif(
    not AIME.exists(), reason=f"real data not found at {AIME} (<repo>/../shared/data)"
)


# --------------------------------------------------------------------------- DAPO-Math / AIME
@pytest.fixture(scope="module")
def dapo() -> list[Prompt]:
    return load_dapo_math(DAPO, hub=None)


@needs_dapo
def test_dapo_math_is_deduplicated_templated_and_keeps_ground_truth(dapo):
    rows = read_parquet_rows(DAPO)
    assert 17_000 < len(dapo) <= len(rows)
    assert len({p.uid for p in dapo}) == len(dapo)
    first = dapo[0]
    text = first.messages[-1]["content"]
    assert text == dapo_template(rows[0]["prompt"][-1]["content"].strip())
    assert text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX)
    assert first.ground_truth == rows[0]["reward_model"]["ground_truth"] == "34"
    assert first.data_source == "DAPO-17k" and [m["role"] for m in first.messages] == ["user"]


@needs_dapo
def test_dapo_math_dedup_removes_hub_style_repeats_and_already_templated_rows(tmp_path):
    # The hub parquet repeats the block and carries the template already: both must collapse.
    rows = read_parquet_rows(DAPO)[:50]
    templated = [
        {**r, "prompt": [{"role": "user", "content": dapo_template(r["prompt"][0]["content"])}]} for r in rows
    ]
    path = tmp_path / "repeated.parquet"
    pq.write_table(pa.Table.from_pylist(rows + templated + rows), path)
    out = load_dapo_math(path, hub=None)
    assert len(out) == len({r["prompt"][0]["content"].strip() for r in rows})
    assert all(p.messages[0]["content"].count(DAPO_PREFIX) == 1 for p in out)


@needs_dapo
def test_dapo_math_falls_back_to_local_parquet_when_the_hub_is_unreachable():
    # A real hub attempt, offline (as here): HF_HUB_OFFLINE makes it fail at once instead of retrying.
    code = (
        "from common.data import load_dapo_math, DAPO_HUB\n"
        f"out = load_dapo_math({str(DAPO)!r}, hub=DAPO_HUB)\n"
        "print('N', len(out))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "unreachable" in proc.stderr and "falling back to the local parquet" in proc.stderr
    assert int(proc.stdout.split("N")[-1]) > 17_000


@needs_dapo
def test_dapo_math_hub_path_reads_a_datasets_repo_and_deduplicates(tmp_path):
    # load_dataset on a local dataset directory runs the same code path as a hub name, offline.
    rows = read_parquet_rows(DAPO)[:40]
    templated = [
        {**r, "prompt": [{"role": "user", "content": dapo_template(r["prompt"][0]["content"])}]} for r in rows
    ]
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(templated * 3), tmp_path / "repo" / "data" / "train-00000.parquet")
    code = (
        "from common.data import load_dapo_math\n"
        f"out = load_dapo_math(None, hub={str(tmp_path / 'repo')!r})\n"
        "print('N', len(out), out[0].messages[0]['content'].count('Solve the following'))\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    n, n_prefix = proc.stdout.split("N")[-1].split()
    assert int(n) == len({r["prompt"][0]["content"].strip() for r in rows}) and int(n_prefix) == 1


def test_dapo_math_without_hub_or_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dapo_math(tmp_path / "missing.parquet", hub=None)
    with pytest.raises(ValueError, match="hub dataset name or a local parquet"):
        load_dapo_math(None, hub=None)


def test_parquet_with_wrong_schema_names_the_missing_column(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}]), path
    )
    with pytest.raises(ValueError, match="missing column 'reward_model'"):
        load_dapo_math(path, hub=None)


@needs_aime
def test_aime_2024_drops_the_boxed_system_prompt_and_uses_the_dapo_template():
    aime = load_aime_2024(AIME)
    assert len(aime) == 30
    for p in aime:
        assert [m["role"] for m in p.messages] == ["user"]
        content = p.messages[0]["content"]
        assert content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX)
        assert "put your final answer within" not in content
        assert p.ground_truth.isdigit() and not p.ground_truth.startswith("0")
    by_truth = {p.ground_truth: p for p in aime}
    assert (
        "540" in by_truth and "Find the largest possible real part" in by_truth["540"].messages[0]["content"]
    )


# --------------------------------------------------------------------------- arithmetic
def test_arithmetic_problems_are_correct_short_and_scored_by_the_dapo_rule():
    probs = arithmetic_dataset(200, seed=3, max_operand=30, ops=["+", "-", "*"])
    assert len({p.uid for p in probs}) == 200
    for p in probs:
        text = p.messages[0]["content"]
        assert text.endswith("=") and len(text) <= 6
        assert int(p.ground_truth) == eval(text[:-1])  # the problem is plain integer arithmetic
        assert score_math_dapo(f"Answer: {p.ground_truth}", p.ground_truth)["acc"]
        assert not score_math_dapo(f"Answer: {int(p.ground_truth) + 1}", p.ground_truth)["acc"]


@pytest.mark.parametrize("train_seed,eval_seed", [(0, 0), (0, 1), (5, 2)])
def test_arithmetic_train_and_eval_are_disjoint_for_any_seeds(train_seed, eval_seed):
    train = arithmetic_dataset(1500, seed=train_seed, max_operand=40, split="train")
    evals = arithmetic_dataset(100, seed=eval_seed, max_operand=40, split="eval")
    assert not {p.uid for p in train} & {p.uid for p in evals}


def test_arithmetic_is_deterministic_per_seed_and_rejects_impossible_requests():
    assert arithmetic_dataset(20, seed=1) == arithmetic_dataset(20, seed=1)
    assert arithmetic_dataset(20, seed=1) != arithmetic_dataset(20, seed=2)
    with pytest.raises(ValueError, match="only"):
        arithmetic_dataset(500, max_operand=5, ops=["+"], split="eval")
    with pytest.raises(ValueError, match="ops"):
        arithmetic_dataset(5, ops=["/"])
    big = arithmetic_dataset(50, seed=0, max_operand=10**6, ops=["*"])  # sampled, not enumerated
    assert len({p.uid for p in big}) == 50


# --------------------------------------------------------------------------- stream
def _uids(batches):
    return [[p.uid for p in b] for b in batches]


def test_prompt_stream_epochs_are_permutations_and_batches_never_repeat_a_uid():
    records = arithmetic_dataset(10, seed=0)
    stream = PromptStream(records, batch_size=3, seed=7)
    epoch0 = _uids(stream.next_batch() for _ in range(3))  # 9 of 10; the remainder 1 is skipped
    epoch1 = _uids(stream.next_batch() for _ in range(3))
    for epoch in (epoch0, epoch1):
        flat = [u for b in epoch for u in b]
        assert len(set(flat)) == 9
    assert epoch0 != epoch1 and stream.epoch == 1


def test_prompt_stream_resume_from_state_dict_continues_exactly():
    records = arithmetic_dataset(25, seed=0)
    full = PromptStream(records, batch_size=4, seed=3)
    reference = _uids(full.next_batch() for _ in range(20))
    first = PromptStream(records, batch_size=4, seed=3)
    head = _uids(first.next_batch() for _ in range(7))
    state = dict(first.state_dict())  # e.g. written to a checkpoint, read back
    resumed = PromptStream(records, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert head + _uids(resumed.next_batch() for _ in range(13)) == reference


def test_prompt_stream_rejects_a_cursor_from_other_data_and_too_small_datasets():
    stream = PromptStream(arithmetic_dataset(12, seed=0), batch_size=4, seed=0)
    other = PromptStream(arithmetic_dataset(13, seed=0), batch_size=4, seed=0)
    with pytest.raises(ValueError, match="num_records"):
        other.load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptStream(arithmetic_dataset(3, seed=0), batch_size=4)


@dataclass
class _DataCfg:  # the fields of rl.config.DataSection that build_datasets reads
    kind: str = "arithmetic"
    train_path: str | None = None
    eval_path: str | None = None
    hub_train: str | None = None
    hub_eval: str | None = None
    num_train: int = 64
    num_eval: int = 16
    max_operand: int = 20
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    seed: int = 0
    max_prompt_tokens: int = 512


def test_build_datasets_arithmetic_gives_stream_and_disjoint_eval():
    stream, evals = build_datasets(_DataCfg(), seed=1, batch_size=8)
    assert len(stream.next_batch()) == 8 and len(evals) == 16
    assert not {p.uid for p in stream.records} & {p.uid for p in evals}


@needs_aime
@needs_dapo
def test_build_datasets_dapo_math_from_local_parquets():
    cfg = _DataCfg(kind="dapo_math", train_path=str(DAPO), eval_path=str(AIME))
    stream, evals = build_datasets(cfg, seed=0, batch_size=4)
    assert len(stream.next_batch()) == 4 and len(evals) == 30
    cfg.max_prompt_tokens = 400
    short_stream, short_evals = build_datasets(cfg, seed=0, batch_size=4, tokenizer=ByteTokenizer())
    tok = ByteTokenizer()
    lengths = [len(tok.chat_prompt(p.messages)) for p in short_stream.records + short_evals]
    assert max(lengths) <= 400 and 0 < len(short_stream.records) < len(stream.records)


# --------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_round_trips_utf8_and_marks_specials():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259 <= 512
    text = "12+35=\nAnswer: 47 — ∑é"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False) == "<s>" + text + "</s>"
    assert tok.encode("ab", add_special_tokens=False) == [ord("a") + 3, ord("b") + 3]
    assert tok.decode([ord("a") + 3, 300, ord("b") + 3]) == "a\ufffdb"  # ids past the byte range
    assert tok.stop_token_ids == (tok.eos_token_id,) == (2,) and tok.pad_token_id == 0


def test_byte_tokenizer_chat_template_is_contents_with_newlines_and_arith_prompts_are_short():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+35="}]
    assert tok.apply_chat_template(msgs) == "be brief\n12+35=\n"
    prompt = arithmetic_dataset(1, seed=0, max_operand=99)[0]
    assert len(tok.chat_prompt(prompt.messages)) <= 8


def test_load_tokenizer_reads_a_local_hf_tokenizer_and_errors_clearly_when_missing(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.decode([3, 4, 2]) == "hello world"
    assert tok.stop_token_ids == (2,) and tok.vocab_size == 6
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "hello\n"  # no template shipped
    with pytest.raises(FileNotFoundError, match=r"model\.tokenizer=byte"):
        load_tokenizer(str(tmp_path / "nope"))


# --------------------------------------------------------------------------- malformed rows
def _row(content="What is 2+2?", truth="4", **kw):
    return {"data_source": "t", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": truth}, **kw}  # fmt: skip


MALFORMED_ROWS = {
    "not_a_mapping": [None, 7, "a row", ["prompt"]],
    "bad_prompt": [
        {"prompt": None, "reward_model": {"ground_truth": "1"}},
        {"prompt": "What is 1?", "reward_model": {"ground_truth": "1"}},
        {"prompt": [None], "reward_model": {"ground_truth": "1"}},
        _row(content=None), _row(content=42), _row(content=["a"]),
        {"reward_model": {"ground_truth": "1"}},
    ],
    "no_user_message": [
        {"prompt": [], "reward_model": {"ground_truth": "1"}},
        {"prompt": [{"role": "system", "content": "x"}], "reward_model": {"ground_truth": "1"}},
        {"prompt": [{"content": "no role"}], "reward_model": {"ground_truth": "1"}},
    ],
    "empty_prompt": [_row(content=""), _row(content="   \n\t"), _row(content=dapo_template(""))],
    "prompt_too_long": [_row(content="9" * (1 << 17))],
    "prompt_not_utf8": [_row(content="2+2\ud800?")],
    "missing_answer": [_row(truth=None), {"prompt": _row()["prompt"]}, _row(reward_model=None),
                       _row(reward_model="4"), _row(reward_model={})],
    "answer_not_string": [_row(truth=4), _row(truth=4.0), _row(truth=True), _row(truth=["4"]),
                          _row(truth={})],
    "empty_answer": [_row(truth=""), _row(truth="  ")],
    "answer_too_long": [_row(truth="1" * 5000)],
}  # fmt: skip


def test_malformed_rows_are_skipped_and_counted_by_reason(caplog):
    rows = [row for bad in MALFORMED_ROWS.values() for row in bad]
    good = [_row(content=f"What is {i}+1?", truth=str(i + 1)) for i in range(3)]
    skipped = Counter()
    out = records_from_rows([good[0], *rows, good[1], good[2]], "t", "t", skipped=skipped)
    assert [p.ground_truth for p in out] == ["1", "2", "3"]
    assert dict(skipped) == {k: len(v) for k, v in MALFORMED_ROWS.items()}
    assert f"skipped {len(rows)} of {len(rows) + 3} rows" in caplog.text
    m = skipped_row_metrics(skipped)
    assert m["data/skipped_rows"] == len(rows) and m["data/skipped_rows/answer_not_string"] == 5


def test_odd_but_valid_text_is_kept():
    rows = [_row(content="\u202ewhat is 2+2\u202c\x00?"), _row(content="(((((a" * 1000, truth="x"),
            _row(content="2+2", data_source=None), _row(content="3+3", data_source=5)]  # fmt: skip
    out = records_from_rows(rows, "dflt", "t")
    assert len(out) == 4 and [p.data_source for p in out[2:]] == ["dflt", "dflt"]


def test_build_datasets_counts_skipped_rows_and_fails_clearly_when_none_are_left(tmp_path):
    path = tmp_path / "mixed.parquet"
    good = [_row(content=f"What is {i}+1?" + " " * 9 + "pad" * 20 * i, truth=str(i + 1)) for i in range(6)]
    bad = [_row(content=""), _row(truth=""), _row(content="x" * (1 << 17))]
    tok = ByteTokenizer()
    third = [{"role": "user", "content": dapo_template(good[2]["prompt"][0]["content"].strip())}]
    limit = len(tok.chat_prompt(third))  # keeps the three shortest prompts
    pq.write_table(pa.Table.from_pylist(good + bad), path)
    stream, evals = build_datasets(_DataCfg(kind="dapo_math", train_path=str(path)), seed=0, batch_size=2)
    assert len(stream.records) == 6 and evals == []
    assert dict(stream.skipped_rows) == {"empty_prompt": 1, "empty_answer": 1, "prompt_too_long": 1}
    stream, _ = build_datasets(_DataCfg(kind="dapo_math", train_path=str(path), max_prompt_tokens=limit),
                               seed=0, batch_size=1, tokenizer=tok)  # fmt: skip
    assert len(stream.records) == 3 and stream.skipped_rows["prompt_too_many_tokens"] == 3
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(ValueError, match=r"only 0 usable training prompts.*empty_answer: 1"):
        build_datasets(_DataCfg(kind="dapo_math", train_path=str(path)), seed=0, batch_size=2)
