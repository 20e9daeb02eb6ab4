"""rl/rewards.py: the DAPO math reward (with the leading-zero fix) and timeout-safe batch scoring."""

import os
import time

import pytest

from rl import rewards
from rl.rewards import ScoringPool, score_batch, score_math_dapo


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
    verl_out = rewards._verl_math_dapo().compute_score("Answer: 007", "7")
    assert verl_out["score"] == -1.0


@pytest.mark.parametrize("pred,truth", [("70", "7"), ("7", "70"), ("-7", "7"), ("0.7", "07"), ("007a", "7")])
def test_score_math_dapo_leading_zero_fix_does_not_accept_different_numbers(pred, truth):
    assert score_math_dapo(f"Answer: {pred}", truth)["score"] == -1.0


def test_score_math_dapo_agrees_with_verl_when_no_zero_padding():
    md = rewards._verl_math_dapo()
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
