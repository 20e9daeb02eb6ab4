"""common/scoring.py (the DAPO math reward with the leading-zero fix) and rl/rewards.py (timeout-safe
batch scoring)."""

import math
import os
import time

import pytest

from common import scoring
from common.scoring import score_math_dapo
from rl.rewards import ERROR_KINDS, ScoringPool, reward_error_metrics, score_batch


# Module-level scorers: worker processes import them by name.
def misbehaving_scorer(text: str, truth: str):
    """Hangs on 'hang', raises on 'raise', kills its process on 'crash', else scores normally."""
    if text == "hang":
        while True:
            time.sleep(0.05)
    if text == "raise":
        raise ValueError("scorer bug")
    if text == "crash":
        os._exit(3)
    return score_math_dapo(text, truth)


def float_scorer(text: str, truth: str) -> float:
    return 0.5 if text == truth else -0.5


# --------------------------------------------------------------------------- score_math_dapo
def test_score_math_dapo_correct_wrong_and_missing_answer():
    assert score_math_dapo("so the total is\nAnswer: 47", "47") == {"score": 1.0, "acc": True, "pred": "47"}
    wrong = score_math_dapo("Answer: 46", "47")
    assert wrong["score"] == -1.0 and wrong["acc"] is False and wrong["pred"] == "46"
    assert score_math_dapo("I think it is 47.", "47")["score"] == -1.0


def test_score_math_dapo_uses_the_last_answer_line():
    assert score_math_dapo("Answer: 3\nwait, no.\nAnswer: 5", "5")["acc"] is True
    assert score_math_dapo("Answer: 5\nwait, no.\nAnswer: 3", "5")["acc"] is False


@pytest.mark.parametrize(
    "pred,truth",
    [("007", "7"), ("7", "007"), ("0", "000"), ("-05", "-5"), ("$025$", "25"), ("1,000", "01000")],
)
def test_score_math_dapo_ignores_leading_zeros_on_integers(pred, truth):
    assert score_math_dapo(f"Answer: {pred}", truth)["score"] == 1.0


def test_leading_zero_fix_is_needed_verl_alone_rejects_zero_padding():
    verl_out = scoring._verl_math_dapo().compute_score("Answer: 007", "7")
    assert verl_out["score"] == -1.0


@pytest.mark.parametrize("pred,truth", [("70", "7"), ("7", "70"), ("-7", "7"), ("0.7", "07"), ("007a", "7")])
def test_score_math_dapo_leading_zero_fix_does_not_accept_different_numbers(pred, truth):
    assert score_math_dapo(f"Answer: {pred}", truth)["score"] == -1.0


def test_score_math_dapo_agrees_with_verl_when_no_zero_padding():
    md = scoring._verl_math_dapo()
    cases = [("Answer: \\frac{1}{2}", "\\frac{1}{2}"), ("Answer: 12 degrees", "12"), ("Answer: x=3", "3"),
             ("Answer: 4", "5"), ("\\boxed{9}", "9"), ("nothing", "1")]  # fmt: skip
    for text, truth in cases:
        ref = md.compute_score(text, truth)
        ours = score_math_dapo(text, truth)
        assert (ours["score"], ours["acc"], ours["pred"]) == (ref["score"], ref["acc"], ref["pred"]), text


# --------------------------------------------------------------------------- score_batch
def test_score_batch_keeps_order_and_scores_each_sample():
    texts = ["Answer: 1", "Answer: 2", "Answer: 04", "junk"]
    out = score_batch(texts, ["1", "3", "4", "5"], timeout_s=10, num_workers=2)
    assert [r["score"] for r in out] == [1.0, -1.0, 1.0, -1.0]
    assert all("error" not in r for r in out)
    assert score_batch([], [], timeout_s=1) == []


def test_score_batch_hanging_raising_and_crashing_scorers_cost_one_sample_each():
    texts = ["Answer: 1", "hang", "raise", "crash", "Answer: 2"]
    t0 = time.monotonic()
    out = score_batch(
        texts, ["1", "1", "1", "1", "2"], timeout_s=1.0, scorer=misbehaving_scorer, num_workers=2
    )
    elapsed = time.monotonic() - t0
    assert [r["score"] for r in out] == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert "timeout" in out[1]["error"]
    assert "ValueError: scorer bug" in out[2]["error"]
    assert "died" in out[3]["error"]
    assert "error" not in out[0] and "error" not in out[4]
    assert elapsed < 15, f"a hung scorer must be cut off near timeout_s, took {elapsed:.1f}s"


def test_scoring_pool_survives_timeouts_across_calls_and_accepts_float_scorers():
    with ScoringPool(misbehaving_scorer, num_workers=1) as pool:
        first = pool.score(["hang", "Answer: 3"], ["3", "3"], timeout_s=0.5)
        second = pool.score(["Answer: 3"], ["3"], timeout_s=5)
        assert [r["score"] for r in first] == [-1.0, 1.0] and second[0]["score"] == 1.0
        assert pool.restarts == 1
    out = score_batch(["a", "b"], ["a", "c"], timeout_s=5, scorer=float_scorer)
    assert [(r["score"], r["acc"]) for r in out] == [(0.5, True), (-0.5, False)]


def test_score_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="ground truths"):
        score_batch(["a"], ["a", "b"], timeout_s=1)


@pytest.mark.slow
def test_score_batch_works_inside_a_ray_actor():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Scorer:
            def run(self, texts, truths):
                return score_batch(texts, truths, timeout_s=1.0, scorer=misbehaving_scorer)

        actor = Scorer.remote()
        out = ray.get(actor.run.remote(["Answer: 7", "hang", "Answer: 007"], ["007", "1", "7"]), timeout=120)
        assert [r["score"] for r in out] == [1.0, -1.0, 1.0] and "timeout" in out[1]["error"]
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- errors and adversarial input
def nonfinite_scorer(text: str, truth: str):
    """NaN, +inf, -inf, or a dict holding NaN, picked by the text."""
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(text, {"score": math.nan})


def hang_scorer(text: str, truth: str) -> float:
    while True:
        time.sleep(0.05)


# Completions built to make naive scoring slow or crash: huge, regex-hostile, odd unicode.
ADVERSARIAL = {
    "megabyte": "x" * (1 << 20) + "\nAnswer: 7",
    "megabyte_one_line": "Answer: " + "9" * (1 << 20),
    "nested_parens": "(((((a" * 10000,
    "nested_boxed": "\\boxed{" * 20000 + "7",
    "boxed_then_answer": "\\boxed{" * 5000 + "}" * 4000 + "\nAnswer: 7",
    "many_dollars": "$" * 200000 + "Answer: $7$",
    "rtl_marks": "\u202eAnswer: 7\u202c\u200f" * 5000,
    "nul_bytes": "\x00" * 100000 + "Answer: 7\x00",
    "lone_surrogates": "\ud800\udfff" * 10000 + "Answer: 7",
    "combining_marks": "7" + "\u0301" * 200000,
    "answer_spam": "Answer: 1\n" * 100000,
    "frac_sqrt": "Answer: " + "\\frac\\sqrt" * 50000,
    "newlines": "\n" * 500000,
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_completion_is_scored_in_bounded_time_in_process(name):
    t0 = time.perf_counter()
    out = score_math_dapo(ADVERSARIAL[name], "7")
    elapsed = time.perf_counter() - t0
    assert out["score"] in (1.0, -1.0) and elapsed < 0.25, f"{name}: {elapsed:.3f}s"


def test_adversarial_batch_through_the_pool_has_no_errors_and_finishes_fast():
    names = sorted(ADVERSARIAL)
    t0 = time.monotonic()
    out = score_batch([ADVERSARIAL[n] for n in names], ["7"] * len(names), timeout_s=5.0)
    elapsed = time.monotonic() - t0
    assert [r for r in out if "error" in r] == [] and all(math.isfinite(r["score"]) for r in out)
    assert out[names.index("megabyte")]["acc"] is True
    assert elapsed < 10, f"{elapsed:.1f}s"


def test_huge_or_regex_hostile_ground_truth_is_bounded_too():
    t0 = time.perf_counter()
    for truth in ("$" * 100000, "(((((a" * 10000, "\\boxed{" * 10000, "7" * (1 << 20)):
        assert score_math_dapo("Answer: 7", truth)["score"] == -1.0
    assert time.perf_counter() - t0 < 1.0


def test_nonfinite_scores_and_invalid_inputs_become_counted_errors():
    with ScoringPool(nonfinite_scorer) as pool:
        out = pool.score(["nan", "inf", "-inf", "dict", None, "x"], ["1", "1", "1", "1", "1", 7], timeout_s=5)
    assert [r["error_kind"] for r in out] == ["nonfinite"] * 4 + ["invalid_input"] * 2
    assert all(r["score"] == -1.0 and r["acc"] is False for r in out)
    assert "non-finite score nan" in out[0]["error"] and "ground truth is int" in out[5]["error"]


def test_reward_error_metrics_count_each_kind():
    texts = ["Answer: 1", "hang", "raise", "crash", 5]
    out = score_batch(texts, ["1"] * 5, timeout_s=1.0, scorer=misbehaving_scorer, num_workers=2)
    m = reward_error_metrics(out)
    assert m["reward/errors"] == 4.0
    assert {k: m[f"reward/errors/{k}"] for k in ERROR_KINDS} == {
        "timeout": 1.0, "exception": 1.0, "died": 1.0, "nonfinite": 0.0, "invalid_input": 1.0
    }  # fmt: skip
    assert reward_error_metrics([{"score": 1.0}])["reward/errors"] == 0.0


def test_batch_timeout_bounds_a_scorer_that_hangs_on_everything():
    t0 = time.monotonic()
    out = score_batch(["a"] * 8, ["a"] * 8, timeout_s=5.0, batch_timeout_s=1.0, scorer=hang_scorer)
    elapsed = time.monotonic() - t0
    assert all(r["error_kind"] == "timeout" for r in out) and "batch" in out[-1]["error"]
    assert elapsed < 4.0, f"8 hung samples x 5 s must be cut at the 1 s batch limit, took {elapsed:.1f}s"
