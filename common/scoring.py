"""DAPO's math reward as a pure function: `score_math_dapo(completion, truth)`.

What: +1 correct / -1 wrong from the last "Answer:" line, Minerva-normalised, via verl's
`math_dapo.compute_score`, plus one fix: integer answers compare without leading zeros ("7" ==
"007"; AIME keys are sometimes zero-padded). Used by the reward workers (rl/rewards.py runs it in
child processes with timeouts) and by the base builders' held-out accuracy.
Invariant: the cost is bounded by construction: only the last `ANSWER_WINDOW_CHARS` of a completion
and the first `MAX_TRUTH_CHARS` of a truth reach any regex.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from types import ModuleType
from typing import Any

# verl's compute_score reads only the last 300 characters (the longest MATH-500 answer is 159); a
# wider window of our own keeps the bound independent of verl's internals.
ANSWER_WINDOW_CHARS = 1024
MAX_TRUTH_CHARS = 1024  # reference answers are short; a longer one is cut before normalisation regexes

_INT_RE = re.compile(r"[+-]?(\d+)")
_math_dapo: ModuleType | None = None


def _verl_math_dapo() -> ModuleType:
    """verl's `reward_score/math_dapo.py`. That file needs only `re`, but importing it the normal way
    runs `verl/__init__`, which pulls in torch and Ray (~7 s per fresh scoring process). So, unless
    verl is already imported, load that one file by path (it is still verl's code, unmodified)."""
    global _math_dapo
    if _math_dapo is None:
        if "verl" in sys.modules:
            _math_dapo = importlib.import_module("verl.utils.reward_score.math_dapo")
        else:
            spec = importlib.util.find_spec("verl")
            if spec is None or not spec.submodule_search_locations:
                raise ModuleNotFoundError(
                    "verl is required for math_dapo scoring: install it (see the Makefile)"
                )
            path = f"{next(iter(spec.submodule_search_locations))}/utils/reward_score/math_dapo.py"
            file_spec = importlib.util.spec_from_file_location("_verl_math_dapo", path)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            _math_dapo = module
    return _math_dapo


def _canonical_int(s: str | None) -> str | None:
    """'007' -> '7', '-0' -> '0', '+12' -> '12'; None for anything that is not a plain integer."""
    if s is None:
        return None
    m = _INT_RE.fullmatch(s.strip())
    if m is None:
        return None
    digits = m.group(1).lstrip("0") or "0"
    return digits if s.strip()[0] != "-" or digits == "0" else "-" + digits


def score_math_dapo(completion_text: str, ground_truth: str) -> dict[str, Any]:
    """DAPO math reward: {'score': +1.0 | -1.0, 'acc': bool, 'pred': normalised prediction | None}.

    verl's `compute_score` decides; a wrong verdict is overturned only when the prediction and the
    (Minerva-normalised) ground truth are both plain integers equal after dropping leading zeros."""
    if not isinstance(completion_text, str) or not isinstance(ground_truth, str):
        raise TypeError(
            f"score_math_dapo needs (str, str), got ({type(completion_text).__name__}, "
            f"{type(ground_truth).__name__})"
        )
    md = _verl_math_dapo()
    completion_text, ground_truth = completion_text[-ANSWER_WINDOW_CHARS:], ground_truth[:MAX_TRUTH_CHARS]
    out = md.compute_score(completion_text, ground_truth)
    score, acc, pred = float(out["score"]), bool(out["acc"]), out["pred"]
    if not acc:
        p, g = _canonical_int(pred), _canonical_int(md.normalize_final_answer(ground_truth))
        if p is not None and p == g:
            score, acc = 1.0, True
    return {"score": score, "acc": acc, "pred": pred}
