"""Bad-input fuzz: malformed recipes, overrides, command lines, server requests and adapter directories.

Every case must be refused with one line naming the problem (no traceback; exit code != 0 for the
CLIs, a 4xx OpenAI-shaped JSON error for the server) and must write nothing outside a temp dir: the
CLIs run with the working directory set to a temp dir, and `git status --porcelain` of the repo is
the same before and after the module. The training entry point must never get past validation:
the trainer and base builders are replaced by tripwires that fail the case if a malformed input was
accepted. Counts are asserted at the end (>= 200 cases in all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
TRIED: Counter = Counter()  # cases run per family, checked by the last test


def _git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True
    ).stdout


@pytest.fixture(scope="module", autouse=True)
def repo_unchanged():
    before = set(_git_status().splitlines())
    yield
    after = set(_git_status().splitlines())
    assert after == before, (
        f"the repository changed: new {sorted(after - before)}, gone {sorted(before - after)}"
    )


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """cwd = a fresh temp dir; the trainer and base builders are tripwires."""
    monkeypatch.chdir(tmp_path)
    import rl.trainer
    import rollout.bases.hf_toy
    import rollout.bases.warmup

    def tripwire(*a, **k):
        raise AssertionError("a malformed input was accepted and reached the trainer")

    monkeypatch.setattr(rl.trainer, "run", tripwire)
    monkeypatch.setattr(rollout.bases.warmup, "ensure_base", tripwire)
    monkeypatch.setattr(rollout.bases.hf_toy, "ensure_hf_toy_base", tripwire)
    return tmp_path


def _check_one_line(err: str, expect: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {err[:2000]!r}"
    assert lines[0].startswith("error:"), lines[0][:500]
    assert expect.lower() in lines[0].lower(), f"{expect!r} not named in {lines[0][:1000]!r}"
    assert len(lines[0]) < 4000, "the error echoes a huge input"


def _run_main(main, argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.err


# ------------------------------------------------------------------------------------ recipes
RECIPES: dict[str, tuple[str, str]] = {  # name -> (YAML text, what the error must name)
    "not_a_mapping_list": ("- a\n- b\n", "mapping"),
    "not_a_mapping_scalar": ("42\n", "mapping"),
    "not_a_mapping_str": ("hello\n", "mapping"),
    "bad_yaml_indent": ("model:\n  preset: tiny\n bad: 1\n", "yaml"),
    "bad_yaml_tab": ("model:\n\tpreset: tiny\n", "yaml"),
    "bad_yaml_unclosed": ("model: {preset: tiny\n", "yaml"),
    "bad_yaml_quote": ('model:\n  preset: "tiny\n', "yaml"),
    "yaml_python_tag": ("model: !!python/object/apply:os.system ['echo hi']\n", "yaml"),
    "yaml_alias_bomb": ("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\nmodel: *b\n", "model"),
    "unknown_top_key": ("modle:\n  preset: tiny\n", "modle"),
    "unknown_section_key": ("trainer:\n  total_stepz: 3\n", "total_stepz"),
    "unknown_nested": ("rollout:\n  sampling:\n    t: 1\n", "sampling"),
    "section_as_scalar": ("trainer: 5\n", "trainer"),
    "section_as_list": ("lora: [1, 2]\n", "lora"),
    "wrong_type_int": ("trainer:\n  total_steps: many\n", "total_steps"),
    "wrong_type_bool": ("trainer:\n  kv_sim: maybe\n", "kv_sim"),
    "wrong_type_float": ("optim:\n  lr: fast\n", "lr"),
    "wrong_type_list": ("lora:\n  target_modules: 5\n", "target_modules"),
    "literal_bad": ("rollout:\n  backend: tensorrt\n", "backend"),
    "literal_bad_dtype": ("model:\n  dtype: fp4\n", "dtype"),
    "negative_steps": ("trainer:\n  total_steps: -1\n", "total_steps"),
    "zero_lr": ("optim:\n  lr: 0\n", "lr"),
    "nan_lr": ("optim:\n  lr: .nan\n", "lr"),
    "top_p_big": ("rollout:\n  top_p: 2.0\n", "top_p"),
    "bad_target": ("lora:\n  target_modules: [qkv]\n", "target_modules"),
    "no_target": ("lora:\n  target_modules: []\n", "no adapter target"),
    "bad_preset": ("model:\n  preset: gigantic\n  checkpoint: null\n", "preset"),
    "no_model": ("model:\n  preset: null\n  checkpoint: null\n", "model"),
    "bad_override_field": ("model:\n  overrides: {hidden_sise: 8}\n", "hidden_sise"),
    "defaults_unknown": ("defaults: [nonexistent_recipe]\n", "nonexistent_recipe"),
    "defaults_bad_type": ("defaults: {a: 1}\n", "defaults"),
    "defaults_self_cycle": ("defaults: [SELF]\n", "cycle"),
    "mini_batch_not_divisor": ("algo:\n  batch_prompts: 8\n  mini_batch_prompts: 3\n", "mini_batch_prompts"),
    "overlong_buffer": ("reward:\n  overlong_buffer: 100\nrollout:\n  max_tokens: 10\n", "overlong_buffer"),
    "cpu_with_gpus": ("rollout:\n  num_gpus: 1\n", "num_gpus"),
    "hf_without_ckpt": ("model:\n  family: hf\n  checkpoint: null\n", "family"),
    "hf_native": ("model:\n  family: hf\n  checkpoint: /x\n", "backend"),
    "learners": ("trainer:\n  num_learners: 0\n", "num_learners"),
    "timeout_zero": ("reward:\n  timeout_s: 0\n", "timeout_s"),
    "ops_bad": ("data:\n  ops: ['/']\n", "ops"),
    "dapo_no_source": ("data:\n  kind: dapo_math\n", "train_path"),
    "betas_bad": ("optim:\n  betas: [0.9, 1.5]\n", "betas"),
    "betas_len": ("optim:\n  betas: [0.9]\n", "betas"),
    "empty_resume": ("resume: ''\n", "resume"),
    "deep_nesting": ("model: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    "huge_string": ("tracking:\n  project: " + "p" * 1_000_000 + "\n  log_samples: -1\n", "log_samples"),
    "nul_in_yaml": ("model:\n  preset: ti\x00ny\n", "yaml"),
    "binary_garbage": ("\xff\xfe\x00\x01garbage", "yaml"),
    "unicode_key": ("modèl:\n  preset: tiny\n", "modèl"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_malformed_recipe_file_is_one_line_error(name, in_tmp, capsys):
    from rl.train import main

    text, expect = RECIPES[name]
    path = in_tmp / f"{name}.yaml"
    path.write_text(text.replace("SELF", name), encoding="utf-8", errors="surrogatepass")
    rc, err = _run_main(main, [f"recipe={path}"], capsys)
    assert rc != 0
    _check_one_line(err, expect)
    TRIED["recipe"] += 1


# ------------------------------------------------------------------------------------ overrides
OVERRIDES: list[tuple[str, str]] = [  # (override, what the error must name)
    ("trainer.total_stepz=3", "total_stepz"),
    ("trainer=3", "trainer"),
    ("trainer.total_steps=abc", "total_steps"),
    ("trainer.total_steps=1.5", "total_steps"),
    ("trainer.total_steps=0", "total_steps"),
    ("trainer.total_steps=-5", "total_steps"),
    ("trainer.total_steps=", "total_steps"),
    ("trainer.total_steps=[1,2]", "total_steps"),
    ("trainer.total_steps={a: 1}", "total_steps"),
    ("trainer.total_steps=true_ish", "total_steps"),
    ("trainer.device=tpu", "device"),
    ("trainer.kv_sim=perhaps", "kv_sim"),
    ("trainer.eval_top_p=0", "eval_top_p"),
    ("trainer.num_learners=0", "num_learners"),
    ("trainer.keep_checkpoints=0", "keep_checkpoints"),
    ("trainer.micro_batch_size=0", "micro_batch_size"),
    ("trainer.seed=x", "seed"),
    ("optim.lr=-1", "lr"),
    ("optim.lr=nan", "lr"),
    ("optim.lr=inf_x", "lr"),
    ("optim.eps=0", "eps"),
    ("optim.betas=[2,3]", "betas"),
    ("optim.betas=0.9", "betas"),
    ("optim.weight_decay=-0.1", "weight_decay"),
    ("optim.grad_clip=-1", "grad_clip"),
    ("optim.warmup_steps=-1", "warmup_steps"),
    ("optim.momentum=0.9", "momentum"),
    ("lora.r=0", "r"),
    ("lora.r=-3", "r"),
    ("lora.r=big", "lora.r"),
    ("lora.alpha=0", "alpha"),
    ("lora.dropout=1", "dropout"),
    ("lora.dropout=-0.5", "dropout"),
    ("lora.target_modules=[]", "no adapter target"),
    ("lora.target_modules=[foo]", "foo"),
    ("lora.target_modules=q_proj", "target_modules"),
    ("lora.dtype=int8", "dtype"),
    ("lora.rank=8", "rank"),
    ("rollout.backend=trt", "backend"),
    ("rollout.n_samples=0", "n_samples"),
    ("rollout.temperature=-1", "temperature"),
    ("rollout.top_p=0", "top_p"),
    ("rollout.top_p=1.01", "top_p"),
    ("rollout.max_tokens=0", "max_tokens"),
    ("rollout.kv_cache_dtype=int4", "kv_cache_dtype"),
    ("rollout.gpu_memory_utilization=2", "gpu_memory_utilization"),
    ("rollout.kv_cache_memory_bytes=0", "kv_cache_memory_bytes"),
    ("rollout.num_workers=0", "num_workers"),
    ("rollout.num_gpus=1", "num_gpus"),
    ("rollout.max_pages=0", "max_pages"),
    ("rollout.vllm_sync=disk", "vllm_sync"),
    ("reward.kind=llm_judge", "kind"),
    ("reward.timeout_s=0", "timeout_s"),
    ("reward.timeout_s=-1", "timeout_s"),
    ("reward.num_workers=0", "num_workers"),
    ("reward.overlong_buffer=1000", "overlong_buffer"),
    ("reward.overlong_penalty=-1", "overlong_penalty"),
    ("algo.batch_prompts=0", "batch_prompts"),
    ("algo.eps_low=1", "eps_low"),
    ("algo.eps_high=-1", "eps_high"),
    ("algo.loss_agg=mean", "loss_agg"),
    ("algo.tis_cap=0", "tis_cap"),
    ("algo.mini_batch_prompts=3", "mini_batch_prompts"),
    ("algo.ppo_epochs=0", "ppo_epochs"),
    ("algo.kl_coef=-1", "kl_coef"),
    ("data.kind=gsm8k", "kind"),
    ("data.ops=[/]", "ops"),
    ("data.ops=[]", "ops"),
    ("data.num_train=0", "num_train"),
    ("data.max_prompt_tokens=0", "max_prompt_tokens"),
    ("data.max_operand=-1", "max_operand"),
    ("model.preset=huge", "preset"),
    ("model.dtype=fp8", "dtype"),
    ("model.family=gpt", "family"),
    ("model.family=hf", "family"),
    ("model.overrides.hidden_sise=8", "hidden_sise"),
    ("model.tokenizer=", "tokenizer"),
    ("model.checkpoint=[a]", "checkpoint"),
    ("tracking.mode=cloud", "mode"),
    ("tracking.project=", "project"),
    ("tracking.log_samples=-1", "log_samples"),
    ("ray.num_cpus=0", "num_cpus"),
    ("ray.num_gpus=-1", "num_gpus"),
    ("resume=[1]", "resume"),
    ("trainer.eval_every=-1", "eval_every"),
    ("=5", "key=value"),
    (" =5", "key=value"),
    ("trainer..total_steps=5", "trainer"),
    ("trainer.total_steps.x=5", "total_steps"),
    (".trainer=5", "key"),
    ("nosuchsection.key=1", "nosuchsection"),
    ("trainer.total_steps=${oops}", "total_steps"),
    ("trainer.total_steps=${oc.env:HOME}", "total_steps"),
    ("trainer.total_steps=5\x00", "total_steps"),
    ("tracking.tags=[[[[", "tags"),
    ("tracking.tags=" + "[" * 3000, "tags"),
    ("trainer.total_steps=" + "9" * 100_000, "total_steps"),
    ("x" * 100_000 + "=1", "unknown key"),
    ("trainer.tötal=1", "tötal"),
    ("trainer.total_steps=\u202e5", "total_steps"),
]


@pytest.mark.parametrize("override,expect", OVERRIDES, ids=[f"o{i}" for i in range(len(OVERRIDES))])
def test_malformed_override_is_one_line_error(override, expect, in_tmp, capsys):
    from rl.train import main

    rc, err = _run_main(main, ["recipe=quickstart", override], capsys)
    assert rc != 0
    _check_one_line(err, expect)
    TRIED["override"] += 1


# ------------------------------------------------------------------------------------ command lines
ARGVS: list[tuple[list[str], str]] = [
    ([], "no recipe"),
    (["quickstart"], "key=value"),
    (["--recipe", "quickstart"], "key=value"),
    (["recipe=nosuch"], "nosuch"),
    (["recipe="], "recipe"),
    (["recipe=../../etc/passwd"], "recipe"),
    (["recipe=/nonexistent/dir/x.yaml"], "recipe"),
    (["recipe=quickstart", "recipe=dapo_math", "trainer.x=1"], "x"),
    (["recipe=quick\x00start"], "recipe"),
    (["recipe=" + "q" * 5000], "recipe"),
    (["recipe=quickstart", "trainer.total_steps"], "key=value"),
    (["recipe=quickstart", "-v"], "key=value"),
    (["recipe=DIR"], "recipe"),
    (["recipe=LIST.yaml"], "mapping"),
]


@pytest.mark.parametrize("argv,expect", ARGVS, ids=[f"a{i}" for i in range(len(ARGVS))])
def test_malformed_command_line_is_one_line_error(argv, expect, in_tmp, capsys):
    from rl.train import main

    (in_tmp / "DIR.yaml").mkdir()
    (in_tmp / "LIST.yaml").write_text("[1, 2]")
    argv = [
        a.replace("=DIR", f"={in_tmp / 'DIR.yaml'}").replace("=LIST.yaml", f"={in_tmp / 'LIST.yaml'}")
        for a in argv
    ]
    rc, err = _run_main(main, argv, capsys)
    assert rc != 0
    _check_one_line(err, expect)
    TRIED["cli"] += 1


SUBPROCESS_ARGVS: list[tuple[list[str], str]] = [
    (["recipe=quickstart", "trainer.total_stepz=3"], "total_stepz"),
    (["recipe=nosuch"], "nosuch"),
    ([], "no recipe"),
    (["recipe=quickstart", "optim.lr=-1"], "lr"),
    (["recipe=quickstart", "rollout.backend=trt"], "backend"),
    (["recipe=quickstart", "lora.target_modules=[foo]"], "foo"),
]


@pytest.mark.parametrize("argv,expect", SUBPROCESS_ARGVS, ids=[f"s{i}" for i in range(len(SUBPROCESS_ARGVS))])
def test_malformed_command_line_in_a_subprocess(argv, expect, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([PY, "-m", "rl.train", *argv], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert p.returncode != 0
    _check_one_line(p.stderr, expect)
    assert list(tmp_path.iterdir()) == []
    TRIED["cli"] += 1


# ------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from common.tokenizer import ByteTokenizer
    from model.config import ModelConfig
    from model.modeling import MiniMaxM3ForCausalLM
    from rollout.native import NativeEngine
    from rollout.server import build_app

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()
    tok = ByteTokenizer()
    engine = NativeEngine(model, max_pages=16, max_batch_tokens=128, kv_dtype="fp32", index_dtype="fp32",
                          detokenize=tok.decode)  # fmt: skip
    app = build_app(engine, tok, model_name="tiny", default_max_tokens=4)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.worker.close()
    torch.set_num_threads(n_threads)


def _ok(**kw):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


def _chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


BIG = 2**70
SERVER_CASES: list[tuple[str, str, object, str]] = [  # (method, path, body | raw bytes, named in error)
    ("POST", "/v1/completions", b"{not json", "json"),
    ("POST", "/v1/completions", b"", "body"),
    ("POST", "/v1/completions", b"\xff\xfe\x00", "json"),
    ("POST", "/v1/completions", b"[]", "body"),
    ("POST", "/v1/completions", b"42", "body"),
    ("POST", "/v1/completions", b'"str"', "body"),
    ("POST", "/v1/completions", b"null", "body"),
    ("POST", "/v1/completions", {}, "model"),
    ("POST", "/v1/completions", {"model": "tiny"}, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi"}, "model"),
    ("POST", "/v1/completions", _ok(model="nope"), "nope"),
    ("POST", "/v1/completions", _ok(model=5), "model"),
    ("POST", "/v1/completions", _ok(prompt=""), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=[]), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=None), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=5), "prompt"),
    ("POST", "/v1/completions", _ok(prompt={"a": 1}), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=[1, "a"]), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=[-1]), "token"),
    ("POST", "/v1/completions", _ok(prompt=[10**9]), "token"),
    ("POST", "/v1/completions", _ok(prompt=[BIG]), "token"),
    ("POST", "/v1/completions", _ok(prompt=[1.5]), "prompt"),
    ("POST", "/v1/completions", _ok(prompt=[[1, 2]]), "prompt"),
    ("POST", "/v1/completions", _ok(prompt="x" * 100_000), "prompt"),
    ("POST", "/v1/completions", _ok(max_tokens=0), "max_tokens"),
    ("POST", "/v1/completions", _ok(max_tokens=-1), "max_tokens"),
    ("POST", "/v1/completions", _ok(max_tokens=10**12), "max_tokens"),
    ("POST", "/v1/completions", _ok(max_tokens=[5]), "max_tokens"),
    ("POST", "/v1/completions", _ok(max_tokens=2.5), "max_tokens"),
    ("POST", "/v1/completions", _ok(temperature=-1), "temperature"),
    ("POST", "/v1/completions", _ok(temperature="hot"), "temperature"),
    ("POST", "/v1/completions", b'{"model":"tiny","prompt":"hi","temperature":NaN}', "temperature"),
    ("POST", "/v1/completions", b'{"model":"tiny","prompt":"hi","temperature":Infinity}', "temperature"),
    ("POST", "/v1/completions", b'{"model":"tiny","prompt":"hi","top_p":-Infinity}', "top_p"),
    ("POST", "/v1/completions", _ok(top_p=0), "top_p"),
    ("POST", "/v1/completions", _ok(top_p=1.5), "top_p"),
    ("POST", "/v1/completions", _ok(top_k=-2), "top_k"),
    ("POST", "/v1/completions", _ok(min_p=2), "min_p"),
    ("POST", "/v1/completions", _ok(n=0), "n"),
    ("POST", "/v1/completions", _ok(n=-1), "n"),
    ("POST", "/v1/completions", _ok(n=10**6), "n"),
    ("POST", "/v1/completions", _ok(n="two"), "n"),
    ("POST", "/v1/completions", _ok(stop=[""]), "stop"),
    ("POST", "/v1/completions", _ok(stop=5), "stop"),
    ("POST", "/v1/completions", _ok(stop=[None]), "stop"),
    ("POST", "/v1/completions", _ok(stop_token_ids=[-1]), "stop_token_ids"),
    ("POST", "/v1/completions", _ok(stop_token_ids="a"), "stop_token_ids"),
    ("POST", "/v1/completions", _ok(seed=-1), "seed"),
    ("POST", "/v1/completions", _ok(seed=BIG), "seed"),
    ("POST", "/v1/completions", _ok(seed="x"), "seed"),
    ("POST", "/v1/completions", _ok(stream=[1]), "stream"),
    ("POST", "/v1/completions", _ok(logprobs=-1), "logprobs"),
    ("POST", "/v1/completions", _ok(ignore_eos="maybe"), "ignore_eos"),
    ("POST", "/v1/completions", _ok(stream=True, max_tokens=0), "max_tokens"),
    ("POST", "/v1/completions", _ok(stream=True, prompt=[10**9]), "token"),
    ("POST", "/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("POST", "/v1/chat/completions", _chat(messages=[]), "messages"),
    ("POST", "/v1/chat/completions", _chat(messages="hi"), "messages"),
    ("POST", "/v1/chat/completions", _chat(messages=[1]), "messages"),
    ("POST", "/v1/chat/completions", _chat(messages=[None]), "messages"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"role": "user"}]), "content"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"content": "x"}]), "role"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"role": 1, "content": "x"}]), "role"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": ["x"]}]), "content"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": None}]), "content"),
    ("POST", "/v1/chat/completions", _chat(max_completion_tokens=0), "max_tokens"),
    ("POST", "/v1/chat/completions", _chat(logprobs="x"), "logprobs"),
    ("POST", "/v1/chat/completions", _chat(model="other"), "other"),
    ("POST", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x" * 100_000}]), "prompt"),
    (
        "POST",
        "/v1/chat/completions",
        b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":1e999}',
        "temperature",
    ),
    ("POST", "/v1/chat/completions", b"{" * 10000, "json"),
    ("POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, "body"),
    ("GET", "/v1/completions", None, "method"),
    ("GET", "/v1/nothing", None, "not found"),
    ("POST", "/v1/models", {}, "method"),
    ("DELETE", "/v1/models", None, "method"),
    ("POST", "/v1/completions", "TEXT", "body"),
]


def test_malformed_server_requests_get_4xx_json_naming_the_problem(client):
    failures = []
    for i, (method, path, body, expect) in enumerate(SERVER_CASES):
        if isinstance(body, bytes):
            r = client.request(method, path, content=body, headers={"content-type": "application/json"})
        elif body == "TEXT":
            r = client.request(method, path, content=b"model=tiny", headers={"content-type": "text/plain"})
        elif body is None:
            r = client.request(method, path)
        else:
            r = client.request(method, path, json=body)
        try:
            payload = r.json()
            msg = payload["error"]["message"]
            ok = 400 <= r.status_code < 500 and "\n" not in msg and expect.lower() in msg.lower()
            ok = ok and len(msg) < 4000 and payload["error"]["code"] == r.status_code
        except Exception as e:  # not JSON, or not OpenAI-shaped
            ok, msg = False, f"{type(e).__name__}: {r.text[:300]}"
        if not ok:
            failures.append(f"case {i} {method} {path} {str(body)[:80]!r}: {r.status_code} {msg[:300]}")
        TRIED["server"] += 1
    assert not failures, "\n".join(failures)
    # the engine thread survived all of that and still serves
    good = client.post("/v1/completions", json=_ok(temperature=0.0))
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) <= 2


# ------------------------------------------------------------------------------------ export
@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory):
    from model.adapter import save_adapter
    from model.config import ModelConfig
    from model.layers.lora import LoRAConfig, apply_lora
    from model.modeling import MiniMaxM3ForCausalLM

    d = tmp_path_factory.mktemp("adapter")
    cfg = LoRAConfig(r=4, target_modules=["q_proj"])
    model = apply_lora(MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")), cfg)
    save_adapter(model, d, cfg, base_model_name_or_path="tiny")
    return d


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
EXPERT_1_A = "base_model.model.model.layers.3.block_sparse_moe.experts.1.w1.lora_A.weight"


def _adapter_cases() -> dict[str, tuple[object, str]]:
    """name -> (function(dir) that damages a copy of the good adapter, what the error must name)."""
    from safetensors.torch import save_file

    def cfg_edit(**kw):
        def f(d):
            raw = json.loads((d / "adapter_config.json").read_text())
            raw.update(kw)
            (d / "adapter_config.json").write_text(json.dumps(raw))

        return f

    def write(name, data):
        def f(d):
            (d / name).write_bytes(data) if isinstance(data, bytes) else (d / name).write_text(data)

        return f

    def unlink(name):
        return lambda d: (d / name).unlink()

    def flip(d):
        b = bytearray((d / "adapter_model.safetensors").read_bytes())
        b[-5] ^= 0xFF
        (d / "adapter_model.safetensors").write_bytes(bytes(b))

    def truncate(d):
        b = (d / "adapter_model.safetensors").read_bytes()
        (d / "adapter_model.safetensors").write_bytes(b[: len(b) // 3])

    def tensors(ts):
        def f(d):
            (d / "checksums.json").unlink()
            save_file(ts, str(d / "adapter_model.safetensors"))

        return f

    w = "adapter_model.safetensors"
    return {
        "no_config": (unlink("adapter_config.json"), "adapter_config.json"),
        "no_weights": (unlink(w), w),
        "config_not_json": (write("adapter_config.json", "{oops"), "invalid json"),
        "config_binary": (write("adapter_config.json", b"\xff\xfe\x00"), "invalid json"),
        "config_list": (write("adapter_config.json", "[1, 2]"), "json object"),
        "config_null": (write("adapter_config.json", "null"), "json object"),
        "config_empty": (write("adapter_config.json", ""), "invalid json"),
        "peft_type": (cfg_edit(peft_type="IA3"), "peft_type"),
        "peft_type_missing": (cfg_edit(peft_type=None), "peft_type"),
        "r_zero": (cfg_edit(r=0), "r"),
        "r_string": (cfg_edit(r="8"), "r"),
        "r_float": (cfg_edit(r=4.5), "r"),
        "r_mismatch": (cfg_edit(r=8), "rank"),
        "alpha_neg": (cfg_edit(lora_alpha=-1), "alpha"),
        "alpha_str": (cfg_edit(lora_alpha="big"), "alpha"),
        "dropout": (cfg_edit(lora_dropout=5), "dropout"),
        "targets_regex": (cfg_edit(target_modules=".*q_proj"), "regex"),
        "targets_ints": (cfg_edit(target_modules=[1, 2]), "target_modules"),
        "targets_dict": (cfg_edit(target_modules={"a": 1}), "target_modules"),
        "targets_unknown": (cfg_edit(target_modules=["self_attn.qkv"]), "qkv"),
        "dora": (cfg_edit(use_dora=True), "use_dora"),
        "bias": (cfg_edit(bias="all"), "bias"),
        "rank_pattern": (cfg_edit(rank_pattern={"q": 2}), "rank_pattern"),
        "weights_flipped": (flip, "corrupted"),
        "weights_truncated": (truncate, "truncated"),
        "weights_empty": (write(w, b""), "truncated"),
        "weights_text": (lambda d: ((d / "checksums.json").unlink(), (d / w).write_text("hello")), "corrupt"),
        "manifest_garbled": (write("checksums.json", "{"), "manifest"),
        "manifest_list": (write("checksums.json", "[]"), "manifest"),
        "manifest_missing_file": (write("checksums.json", json.dumps({"files": {}})), "not listed"),
        "metadata_not_json": (write("adapter_metadata.json", "{"), "adapter_metadata.json"),
        "metadata_list": (write("adapter_metadata.json", "[]"), "adapter_metadata.json"),
        "metadata_unknown": (write("adapter_metadata.json", '{"bogus": 1}'), "bogus"),
        "metadata_metrics_type": (write("adapter_metadata.json", '{"metrics": [1]}'), "metrics"),
        "metadata_step_type": (write("adapter_metadata.json", '{"step": "ten"}'), "step"),
        "metadata_dtype": (write("adapter_metadata.json", '{"adapter_dtype": "int8"}'), "dtype"),
        "tensor_bad_prefix": (tensors({"foo.lora_A.weight": torch.zeros(4, 8)}), "base_model.model"),
        "tensor_1d": (tensors({Q_A: torch.zeros(4)}), "not a lora factor"),
        "tensor_int": (tensors({Q_A: torch.zeros(4, 8, dtype=torch.int32)}), "not a lora factor"),
        "experts_gap": (tensors({EXPERT_1_A: torch.zeros(4, 8)}), "experts 0..e-1"),
    }


def test_malformed_adapter_dirs_for_export_are_one_line_errors(good_adapter, tmp_path, monkeypatch, capsys):
    import shutil

    from rl.export import main

    monkeypatch.chdir(tmp_path)
    failures = []
    cases = _adapter_cases()
    for name, (damage, expect) in cases.items():
        d = tmp_path / name
        shutil.copytree(good_adapter, d)
        damage(d)
        rc, err = _run_main(main, [str(d), "--out", str(tmp_path / f"out-{name}")], capsys)
        try:
            assert rc != 0
            _check_one_line(err, expect)
        except AssertionError as e:
            failures.append(f"{name}: rc={rc} {str(e)[:400]}")
        TRIED["export"] += 1
    # argument errors and impossible sources
    argv_cases = [
        ([], "required"),
        ([str(good_adapter)], "--out"),
        ([str(good_adapter), "--out", "o", "--format", "gguf"], "format"),
        ([str(good_adapter), "--out", "o", "--probe-tokens", "x"], "probe-tokens"),
        ([str(tmp_path / "nowhere"), "--out", "o"], "no such directory"),
        ([str(tmp_path / "empty_dir"), "--out", "o"], "adapter_config.json"),
        ([str(good_adapter), "--out", "o", "--format", "merged"], "--base"),
        ([str(good_adapter), "--out", "o", "--format", "merged", "--base", str(tmp_path / "nope")], "--base"),
        ([str(good_adapter), "--out", "o", "--base", str(tmp_path / "empty_dir")], "config.json"),
        ([str(good_adapter), "--out", str(tmp_path / "a_file")], "a_file"),
    ]
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    for argv, expect in argv_cases:
        rc, err = _run_main(main, argv, capsys)
        try:
            assert rc != 0
            _check_one_line(err, expect)
        except AssertionError as e:
            failures.append(f"{argv}: rc={rc} {str(e)[:400]}")
        TRIED["export"] += 1
    assert not failures, "\n".join(failures)


def test_export_cli_in_a_subprocess(good_adapter, tmp_path):
    import shutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    d = tmp_path / "bad"
    shutil.copytree(good_adapter, d)
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    for argv, expect in [([str(d), "--out", "o"], "truncated"), ([str(d)], "--out")]:
        p = subprocess.run([PY, "-m", "rl.export", *argv], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=120)  # fmt: skip
        assert p.returncode != 0
        _check_one_line(p.stderr, expect)
        TRIED["export"] += 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_at_least_200_bad_inputs_are_tried():
    n_export = len(_adapter_cases()) + 10 + 2  # damaged dirs + argument cases + subprocess cases
    counts = {"recipe": len(RECIPES), "override": len(OVERRIDES), "cli": len(ARGVS) + len(SUBPROCESS_ARGVS),
              "server": len(SERVER_CASES), "export": n_export}  # fmt: skip
    print(f"bad inputs: {counts} = {sum(counts.values())}; run in this session: {dict(TRIED)}")
    assert sum(counts.values()) >= 200
    assert all(TRIED[k] in (0, n) for k, n in counts.items()), "a family ran only partly"


class _FailingEngine:
    """Accepts requests; its step raises, as a bug deep in an engine would."""

    def __init__(self):
        self.pending = 0

    def add_request(self, request, on_token=None):
        self.pending += 1
        return request.request_id

    def has_unfinished(self):
        return self.pending > 0

    def step(self):
        raise IndexError("index 7 is out of bounds")


@pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")  # a hang must fail, not block
def test_engine_failure_without_abort_fails_the_request_then_503s_and_health_says_so():
    from fastapi.testclient import TestClient

    from common.tokenizer import ByteTokenizer
    from rollout.server import build_app

    app = build_app(_FailingEngine(), ByteTokenizer(), model_name="m")
    with TestClient(app, raise_server_exceptions=False) as c:
        first = c.post("/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30)
        second = c.post("/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30)
        health = c.get("/health")
    app.state.worker.close()
    assert first.status_code == 500 and "IndexError: index 7" in first.json()["error"]["message"]
    # The engine cannot drop what it holds: later requests fail fast (no hang), /health says why.
    assert second.status_code == 503 and "restart the server" in second.json()["error"]["message"]
    assert health.status_code == 503 and "cannot drop" in health.json()["error"]["message"]
