"""The trainer's entry point under a careless user (issue 25 item 7): a bad output_dir, a corrupt or
truncated model shard (read inside Ray actors), a damaged data file. Each is a real
`python -m rl.train` process that must exit 2 with one stderr line naming the path and the fix,
and write nothing outside its output_dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
QUICK = ["recipe=quickstart", "model.warmup=false", "trainer.total_steps=1", "algo.batch_prompts=4",
         "rollout.n_samples=2", "trainer.eval_every=0"]  # fmt: skip


def _train(args: list[str], cwd: Path) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    p = subprocess.run([sys.executable, "-m", "rl.train", *args], cwd=cwd, capture_output=True, text=True,
                       env=env, timeout=300)  # fmt: skip
    return p.returncode, [ln for ln in p.stderr.splitlines() if ln.strip()]


def _one_line(rc: int, lines: list[str], *words: str) -> None:
    assert rc == 2 and len(lines) == 1, (rc, lines[:40])
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0], lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from common.tokenizer import write_tokenizer_record
    from model.checkpoint import save_model
    from model.config import ModelConfig
    from model.modeling import MiniMaxM3ForCausalLM

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0)
    save_model(model, d, max_shard_bytes=300_000)
    write_tokenizer_record(d, "byte")
    return d


@pytest.mark.parametrize("case", ["file", "under_a_file", "unwritable"])
def test_a_bad_output_dir_is_one_line_naming_it_and_nothing_is_written(case, tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    out = {"file": tmp_path / "taken", "under_a_file": tmp_path / "taken" / "run"}.get(case)
    if case == "unwritable":
        if os.geteuid() == 0:  # root writes anywhere the file system allows: use one it refuses
            out = Path("/sys/nvfp4-rl-run")
        else:
            (tmp_path / "ro").mkdir(mode=0o500)
            out = tmp_path / "ro" / "run"
    before = _files(tmp_path)
    rc, lines = _train([*QUICK, f"output_dir={out}"], tmp_path)
    _one_line(rc, lines, f"output_dir {str(out)!r}", "Fix: set output_dir=")
    assert _files(tmp_path) == before


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "manifest", "words"),
    [
        ("flip", True, ["is corrupted", "re-copy"]),
        # Each case starts Ray and its actors (about a minute on 2 shared cores): the variations are slow.
        pytest.param("truncate", True, ["re-copy"], marks=pytest.mark.slow),
        pytest.param("flip_header", False, [], marks=pytest.mark.slow),
        pytest.param("truncate", False, [], marks=pytest.mark.slow),
    ],
)
def test_a_corrupt_base_shard_read_in_ray_actors_is_one_line_naming_the_file(
    tiny_checkpoint, tmp_path, damage, manifest, words
):
    ckpt = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, ckpt)
    if not manifest:
        (ckpt / "checksums.json").unlink()
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    {"flip": lambda: _flip(shard, shard.stat().st_size // 2), "flip_header": lambda: _flip(shard, 9),
     "truncate": lambda: _truncate(shard)}[damage]()  # fmt: skip
    rc, lines = _train([*QUICK, f"model.checkpoint={ckpt}", f"output_dir={tmp_path / 'run'}"], tmp_path)
    _one_line(rc, lines, "CheckpointError", shard.name, *words)
    assert {p.split("/")[0] for p in _files(tmp_path)} <= {"base", "run"}


def _damaged_parquet(tmp_path: Path, damage: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    row = {"prompt": [[{"role": "user", "content": "1+1?"}]], "reward_model": [{"ground_truth": "2"}],
           "data_source": ["x"]}  # fmt: skip
    pq.write_table(pa.table(row), good)
    bad = tmp_path / "train.parquet"
    if damage == "text":
        bad.write_text("not a parquet at all")
    else:
        shutil.copy(good, bad)
        _truncate(bad) if damage == "truncated" else _flip(bad, bad.stat().st_size - 2)
    return bad


@pytest.mark.parametrize("damage", ["text", "truncated", "flipped_footer"])
def test_a_damaged_parquet_is_an_error_naming_the_file_and_the_key(tmp_path, damage):
    from common.data import load_aime_2024, load_dapo_math

    bad = _damaged_parquet(tmp_path, damage)
    for load, key in ((load_dapo_math, "data.train_path"), (load_aime_2024, "data.eval_path")):
        with pytest.raises(
            ValueError, match=rf"^{key}: '{bad}' is not a readable parquet file .* Fix: point {key}"
        ):
            load(bad, hub=None)


def test_a_damaged_parquet_ends_the_run_with_one_line(tmp_path):
    bad = _damaged_parquet(tmp_path, "flipped_footer")
    data = ["data.kind=dapo_math", f"data.train_path={bad}", "data.hub_train=null", "data.hub_eval=null"]
    args = [*QUICK, *data, f"output_dir={tmp_path / 'run'}"]
    rc, lines = _train(args, tmp_path)
    _one_line(rc, lines, "data.train_path", str(bad), "not a readable parquet", "Fix:")
    assert {p.split("/")[0] for p in _files(tmp_path)} <= {"good.parquet", "train.parquet", "run"}
