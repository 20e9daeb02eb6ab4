"""geo_vision data: the Geometry3K-format generator (common/geo_data.py), the loader into image+text prompts
(common/data.py), the hub-then-local fallback, skipped-row counts, and the recipe."""

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.data import build_datasets, load_geo_vision, skipped_row_metrics
from common.geo_data import (
    GEO_SUFFIX,
    IMAGE_MARKER,
    _generate,
    generate_split,
    image_data_url,
    records_from_geo3k_rows,
    write_parquet,
)
from common.scoring import score_math_dapo
from rl.config import load_config

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "data" / "geo_vision"
PNG_URL = "data:image/png;base64,"


def _png(size=(32, 24), colour=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def _row(problem=f"{IMAGE_MARKER}Find x.", answer="5", images=None) -> dict:
    return {"problem": problem, "answer": answer,
            "images": [{"bytes": _png(), "path": None}] if images is None else images}  # fmt: skip


def _decode(url: str) -> Image.Image:
    assert url.startswith(PNG_URL)
    img = Image.open(io.BytesIO(base64.b64decode(url[len(PNG_URL) :])))
    img.load()
    return img


# --------------------------------------------------------------------------- the generator
def test_generator_same_seed_gives_the_same_png_bytes_and_parquet_file(tmp_path):
    a, b = generate_split("train", 18, seed=3), generate_split("train", 18, seed=3)
    assert a == b
    assert generate_split("train", 18, seed=4) != a
    write_parquet(a, tmp_path / "a.parquet")
    write_parquet(b, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


def test_generated_rows_are_geometry3k_format_with_integer_answers_and_small_images():
    rows = generate_split("test", 12, seed=0, size=64)
    for r in rows:
        assert set(r) == {"images", "problem", "answer"} and r["problem"].startswith(IMAGE_MARKER)
        assert int(r["answer"]) >= 0 and str(int(r["answer"])) == r["answer"]
        (image,) = r["images"]
        img = Image.open(io.BytesIO(image["bytes"]))
        assert img.format == "PNG" and img.size == (64, 64)
    stems = ["Find the length of the hypotenuse", "Find the area of the right", "Find the perimeter",
             "Find the area of the rectangle", "How many", "What is the value of bar"]  # fmt: skip
    assert [r["problem"].startswith(IMAGE_MARKER + stem) for r, stem in zip(rows, stems * 2)] == [True] * 12


def test_train_and_test_share_no_problem_parameters_and_no_picture():
    train, test = _generate("train", 300, 0, 96), _generate("test", 64, 0, 96)
    assert not {(k, p) for k, p, _ in train} & {(k, p) for k, p, _ in test}
    train_png = {r["images"][0]["bytes"] for *_, r in train}
    test_png = {r["images"][0]["bytes"] for *_, r in test}
    assert len(train_png) == 300 and len(test_png) == 64 and not train_png & test_png


def test_parquet_round_trip_keeps_rows_and_the_datasets_image_features(tmp_path):
    rows = generate_split("train", 7, seed=1)
    write_parquet(rows, tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.to_pylist() == rows
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["images"]["feature"]["_type"] == "Image"


def test_shipped_local_parquet_is_what_the_generator_cli_writes():
    sizes = [p.stat().st_size for p in LOCAL.glob("*.parquet")]
    assert len(sizes) == 2 and sum(sizes) < 2 * 1024 * 1024
    assert pq.read_table(LOCAL / "test.parquet").to_pylist() == generate_split("test", 64, seed=0, size=96)
    train = pq.read_table(LOCAL / "train.parquet").to_pylist()
    assert len(train) == 1000 and train[:50] == generate_split("train", 50, seed=0, size=96)


# --------------------------------------------------------------------------- the loader
def test_loader_gives_image_then_text_prompts_with_decodable_images_and_ground_truths():
    rows = pq.read_table(LOCAL / "test.parquet").to_pylist()
    skipped = Counter()
    prompts = load_geo_vision(LOCAL / "test.parquet", hub=None, split="test", skipped=skipped)
    assert len(prompts) == 64 and not skipped and len({p.uid for p in prompts}) == 64
    for p, row in zip(prompts, rows, strict=True):
        (msg,) = p.messages
        image_part, text_part = msg["content"]
        assert msg["role"] == "user" and set(image_part) == {"type", "image_url"}
        assert image_part["type"] == "image_url" and text_part["type"] == "text"
        img = _decode(image_part["image_url"]["url"])
        assert img.size == (96, 96)
        assert base64.b64decode(image_part["image_url"]["url"][len(PNG_URL) :]) == row["images"][0]["bytes"]
        assert text_part["text"] == row["problem"].replace(IMAGE_MARKER, "") + GEO_SUFFIX
        assert p.ground_truth == row["answer"] and p.data_source == "geo_vision"


def test_math_dapo_reward_scores_the_integer_answers_by_the_final_answer_line():
    prompts = load_geo_vision(LOCAL / "test.parquet", hub=None, split="test")
    for p in prompts[:12]:
        assert score_math_dapo(f"I count.\nAnswer: {p.ground_truth}", p.ground_truth)["score"] == 1.0
        assert score_math_dapo(f"Answer: {int(p.ground_truth) + 1}", p.ground_truth)["score"] == -1.0


def test_image_markers_place_images_in_the_text_and_no_marker_puts_images_first(tmp_path):
    red, blue = _png(colour=(255, 0, 0)), _png(colour=(0, 0, 255))
    two = _row(f"Compare {IMAGE_MARKER} with {IMAGE_MARKER}. Which is larger?",
               images=[{"bytes": red, "path": None}, {"bytes": blue, "path": None}])  # fmt: skip
    (p,) = records_from_geo3k_rows([two], "t", "t", max_images=2)
    parts = p.messages[0]["content"]
    assert [q["type"] for q in parts] == ["text", "image_url", "text", "image_url", "text"]
    assert [q["text"] for q in parts[::2]] == ["Compare", "with", ". Which is larger?" + GEO_SUFFIX]
    assert _decode(parts[1]["image_url"]["url"]).getpixel((0, 0)) == (255, 0, 0)
    assert _decode(parts[3]["image_url"]["url"]).getpixel((0, 0)) == (0, 0, 255)
    # No marker: images first. A decoded PIL image (datasets' default) and a path-only struct work too.
    (tmp_path / "b.png").write_bytes(blue)
    rows = [_row("Find y.", images=[Image.open(io.BytesIO(red))]),
            _row("Find z.", images=[{"bytes": None, "path": str(tmp_path / "b.png")}])]  # fmt: skip
    out = records_from_geo3k_rows(rows, "t", "t")
    assert [[q["type"] for q in p.messages[0]["content"]] for p in out] == [["image_url", "text"]] * 2
    assert _decode(out[1].messages[0]["content"][0]["image_url"]["url"]).getpixel((3, 3)) == (0, 0, 255)


def test_same_problem_text_with_different_images_is_kept_and_exact_repeats_are_dropped():
    a, b = _row(images=[{"bytes": _png(colour=(1, 2, 3))}]), _row(images=[{"bytes": _png(colour=(3, 2, 1))}])
    out = records_from_geo3k_rows([a, b, a], "t", "t")
    assert len(out) == 2 and out[0].uid != out[1].uid
    assert [p.uid for p in records_from_geo3k_rows([b, a], "t", "t")] == [out[1].uid, out[0].uid]


BAD_ROWS = {
    "not_a_mapping": [None, "row"],
    "bad_prompt": [_row(problem=None), _row(problem=["x"])],
    "empty_prompt": [_row(problem=f"{IMAGE_MARKER}  \n")],
    "missing_answer": [_row(answer=None), {"problem": "Find x.", "images": [{"bytes": _png()}]}],
    "answer_not_string": [_row(answer=5), _row(answer=5.0)],
    "empty_answer": [_row(answer=" ")],
    "no_image": [_row(images=[]), {"problem": "Find x.", "answer": "1"}],
    "too_many_images": [_row(images=[{"bytes": _png()}, {"bytes": _png()}])],
    "image_marker_mismatch": [_row(problem=f"{IMAGE_MARKER}a{IMAGE_MARKER}b")],
    "bad_image": [
        _row(images=[{"bytes": b"not an image", "path": None}]),
        _row(images=[{"bytes": _png()[:60], "path": None}]),  # truncated PNG
        _row(images=[{"bytes": None, "path": "/nonexistent/x.png"}]),
        _row(images=[{"bytes": _png(fmt="TIFF"), "path": None}]),  # decodable, but not a tower format
        _row(images=[7]),
    ],
    "image_too_large": [_row(images=[{"bytes": _png(size=(200, 100)), "path": None}])],
}


def test_bad_rows_are_skipped_and_counted_by_reason(caplog):
    rows = [r for bad in BAD_ROWS.values() for r in bad]
    good = [_row(answer=str(i), images=[{"bytes": _png(colour=(i, i, i))}]) for i in range(3)]
    skipped = Counter()
    out = records_from_geo3k_rows([good[0], *rows, *good[1:]], "t", "geo", skipped=skipped,
                                  max_image_pixels=100 * 100)  # fmt: skip
    assert [p.ground_truth for p in out] == ["0", "1", "2"]
    assert dict(skipped) == {k: len(v) for k, v in BAD_ROWS.items()}
    assert f"skipped {len(rows)} of {len(rows) + 3} rows" in caplog.text
    metrics = skipped_row_metrics(skipped)
    assert metrics["data/skipped_rows"] == len(rows) and metrics["data/skipped_rows/bad_image"] == 5


def test_image_data_url_checks_size_before_decoding_and_names_the_format():
    assert image_data_url(_png(size=(64, 64)), max_pixels=64 * 64).startswith(PNG_URL)
    assert image_data_url(_png(size=(64, 65)), max_pixels=64 * 64) == "image_too_large"
    assert image_data_url(_png(fmt="JPEG")).startswith("data:image/jpeg;base64,")
    assert image_data_url(b"") == "bad_image"


# --------------------------------------------------------------------------- hub and fallback
def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # HF_HUB_OFFLINE makes a hub attempt fail at once (this machine has no network) instead of retrying.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_unreachable_hub_falls_back_to_the_local_parquet_with_a_message(tmp_path):
    code = (
        "from common.data import load_geo_vision, GEO3K_HUB\n"
        "out = load_geo_vision('data/geo_vision/test.parquet', hub=GEO3K_HUB, split='test')\n"
        "print('N', len(out))\n"
    )
    proc = _run(code, tmp_path)
    assert "hub dataset 'hiyouga/geometry3k' unreachable" in proc.stderr
    assert "falling back to the local parquet data/geo_vision/test.parquet" in proc.stderr
    assert int(proc.stdout.split("N")[-1]) == 64


def test_hub_path_reads_a_datasets_repo_with_image_features_like_the_local_parquet(tmp_path):
    # load_dataset on a local dataset directory runs the same code path as a hub name, offline; the
    # files carry datasets' Image feature metadata as the hub's do, so images arrive as Image features.
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split in ("train", "test"):
        rows = generate_split(split, 12)
        write_parquet(rows, tmp_path / "repo" / "data" / f"{split}-00000-of-00001.parquet")
    code = (
        "import hashlib\n"
        "from common.data import load_geo_vision\n"
        f"out = load_geo_vision(None, hub={str(tmp_path / 'repo')!r}, split='test')\n"
        "print('N', len(out), hashlib.sha1(repr([p.messages for p in out]).encode()).hexdigest())\n"
    )
    n, digest = _run(code, tmp_path).stdout.split("N")[-1].split()
    write_parquet(generate_split("test", 12), tmp_path / "local.parquet")
    local = load_geo_vision(tmp_path / "local.parquet", hub=None, split="test")
    assert int(n) == 12 and digest == hashlib.sha1(repr([p.messages for p in local]).encode()).hexdigest()


def test_no_hub_and_no_file_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not found.*python -m common.geo_data"):
        load_geo_vision(tmp_path / "missing.parquet", hub=None)
    with pytest.raises(ValueError, match="hub dataset name or a local parquet"):
        load_geo_vision(None, hub=None)
    pq.write_table(pa.Table.from_pylist([{"problem": "x", "answer": "1"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"missing column 'images' \(needs Geometry3K-style"):
        load_geo_vision(tmp_path / "bad.parquet", hub=None)


# --------------------------------------------------------------------------- the recipe
def test_geo_vision_recipe_parses_and_builds_its_datasets_from_the_local_copy():
    cfg = load_config("geo_vision", ["data.hub_train=null", "data.hub_eval=null"])
    assert (cfg.model.preset, cfg.data.kind, cfg.rollout.backend) == ("tiny-vl", "geo_vision", "native")
    assert (cfg.data.hub_train_split, cfg.data.hub_eval_split, cfg.data.max_images) == ("train", "test", 1)
    assert load_config("geo_vision").data.hub_train == "hiyouga/geometry3k"
    stream, evals = build_datasets(cfg.data, seed=0, batch_size=cfg.algo.batch_prompts)
    assert len(stream.records) == 1000 and len(evals) == 64 and not stream.skipped_rows
    assert len(stream.next_batch()) == cfg.algo.batch_prompts
    assert not {p.uid for p in stream.records} & {p.uid for p in evals}


def test_build_datasets_geo_vision_counts_skipped_rows(tmp_path):
    rows = generate_split("train", 6)
    bad = [
        {**rows[0], "images": [{"bytes": b"junk", "path": None}]},
        {**rows[1], "images": rows[1]["images"] * 2},
    ]
    write_parquet(rows + bad, tmp_path / "mixed.parquet")
    over = ["data.hub_train=null", "data.hub_eval=null", f"data.train_path={tmp_path / 'mixed.parquet'}",
            "data.eval_path=null"]  # fmt: skip
    stream, evals = build_datasets(load_config("geo_vision", over).data, seed=0, batch_size=2)
    assert len(stream.records) == 6 and evals == []
    assert dict(stream.skipped_rows) == {"bad_image": 1, "too_many_images": 1}


def test_geo_vision_config_rejects_bad_image_limits():
    with pytest.raises(ValueError, match=r"data\.max_images must be >= 1"):
        load_config("geo_vision", ["data.max_images=0"])
    with pytest.raises(ValueError, match="hub_eval_split must name a split"):
        load_config("geo_vision", ["data.hub_eval_split=''"])


def test_prompt_length_filter_counts_text_tokens_not_the_images_base64():
    from common.data import Prompt, filter_prompt_length
    from common.tokenizer import ByteTokenizer

    pixels = np.random.RandomState(0).randint(0, 256, (96, 96, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")  # ~28 KB: ~37K base64 characters
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def prompt(uid: str, text: str) -> Prompt:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        return Prompt(uid, [{"role": "user", "content": parts}], "1", "geo")

    short, long = prompt("a", "Find x."), prompt("b", "Find x. " * 200)
    skipped = Counter()
    kept = filter_prompt_length([short, long], ByteTokenizer(), 1024, skipped)
    assert [p.uid for p in kept] == ["a"]  # the image does not count; the 1600-char text does
    assert skipped["prompt_too_many_tokens"] == 1
