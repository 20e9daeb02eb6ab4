"""A newcomer's loop (issue 26): train a short quickstart run, serve its adapter with the README's one
command (`python -m rollout.serve --model runs/_cache/quickstart-base --adapter RUN/adapter`, no
tokenizer flag), and get the held-out accuracy the trainer's eval measured, within 2 points, through
the real `openai` client over HTTP (greedy; completions and chat).

Slow: a real `rl.train` process (Ray, rollout + learner actors) plus a real server process; the base
is the cached quickstart base (runs/_cache, built once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from rollout.bases.warmup import ensure_base
from tests.rollout.live_server import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "runs" / "_cache" / "quickstart-base"
STEPS = 2


def _wait_for_health(url: str, proc: subprocess.Popen, seconds: float = 180.0) -> None:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not answer /health within {seconds} s")


def test_the_served_adapter_gets_the_trainers_held_out_accuracy(tmp_path):
    from common.data import build_datasets
    from common.scoring import score_math_dapo
    from rl.config import load_config

    ensure_base(BASE)
    run = tmp_path / "quickstart-test"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    train = [sys.executable, "-m", "rl.train", "recipe=quickstart", f"model.checkpoint={BASE}",
             f"trainer.total_steps={STEPS}", f"trainer.eval_every={STEPS}", "trainer.save_every=0",
             f"output_dir={run}"]  # fmt: skip
    p = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/acc" in r]
    trained_acc = evals[-1]["eval/acc"]

    cfg = load_config("quickstart", [f"model.checkpoint={BASE}"])
    _, problems = build_datasets(cfg.data, seed=cfg.trainer.seed, batch_size=cfg.algo.batch_prompts)
    assert len(problems) == cfg.data.num_eval

    port = free_port()
    serve = [sys.executable, "-m", "rollout.serve", "--model", str(BASE), "--adapter", str(run / "adapter"),
             "--port", str(port), "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(serve, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_health(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["quickstart-base", "adapter"]
        greedy = {"model": "adapter", "temperature": 0.0, "max_tokens": cfg.rollout.max_tokens}

        def chat(p) -> str:
            return client.chat.completions.create(messages=p.messages, **greedy).choices[0].message.content

        def completion(p) -> str:
            from common.tokenizer import load_tokenizer

            prompt = load_tokenizer(cfg.model.tokenizer).apply_chat_template(p.messages)
            return client.completions.create(prompt=prompt, **greedy).choices[0].text

        accuracy = {}
        for name, ask in (("chat", chat), ("completions", completion)):
            with ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(ask, problems))
            accuracy[name] = sum(
                score_math_dapo(t, p.ground_truth)["acc"] for t, p in zip(texts, problems)
            ) / len(problems)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"held-out greedy accuracy: trainer eval {trained_acc:.3f}, served {accuracy}")
    for name, acc in accuracy.items():
        assert abs(acc - trained_acc) <= 0.02, (name, acc, trained_acc)
