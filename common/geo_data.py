"""geo_vision: Geometry3K-format visual math data — rows to image+text prompts, and a diagram generator.

What: `records_from_geo3k_rows` turns rows in the hub's Geometry3K format (`hiyouga/geometry3k`:
`images`, `problem` with one `<image>` marker per image, `answer`) into `common.data.Prompt`s with one
user message of OpenAI-style content parts (images as base64 data URLs in marker order, then the text
plus the "Answer:" instruction rl/rewards.py scores). `generate_split` / `python -m common.geo_data
--out data/geo_vision` write a small synthetic dataset in that format (rendered diagrams with integer
answers), so the `geo_vision` recipe also runs offline from a local parquet.

Invariants: generation is a pure function of (split, n, seed, size); train and test problems are
disjoint by their parameters; a bad row (undecodable or oversized image, image count or markers that
do not match, no answer) is skipped and counted by reason, never a crash.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from common.data import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_PROMPT_CHARS,
    Prompt,
    SkipReason,
    answer_skip_reason,
    log_skipped,
    prompt_uid,
)

# One prompt's message:
#     [{"role": "user", "content": [
#         {"type": "image_url", "image_url": {"url": "data:image/png;base64,<...>"}},
#         {"type": "text", "text": "<problem without the marker>" + GEO_SUFFIX}]}]
# Synthetic diagrams: right triangles, rectangles, coloured dots, bar charts at `size` px; answers are
# a hypotenuse, an area, a perimeter, a count or a bar's value. The split is a fixed hash of a
# problem's numbers (layouts only vary the picture); the same arguments give the same PNG bytes.

GEO3K_COLUMNS = ("images", "problem", "answer")
GEO3K_SCHEMA = "Geometry3K-style columns images = [{bytes, path}], problem (with <image>), answer"
IMAGE_MARKER = "<image>"
# The formats the vision tower's preprocessing decodes (model.vision.preprocess.SUPPORTED_FORMATS):
# a row with any other format would only fail later, in a rollout.
IMAGE_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif",
              "BMP": "image/bmp"}  # fmt: skip
GEO_SUFFIX = '\n\nGive the final answer on its own last line as "Answer: <answer>".'
TEST_MODULUS = 8  # problems whose parameter hash % TEST_MODULUS == 0 form the test split (12.5%)
Kind = Literal["hypotenuse", "triangle_area", "rect_perimeter", "rect_area", "count_dots", "bar_value"]
KINDS: tuple[Kind, ...] = (
    "hypotenuse", "triangle_area", "rect_perimeter", "rect_area", "count_dots", "bar_value",
)  # fmt: skip
GeoSplit = Literal["train", "test"]


# --------------------------------------------------------------------------- rows -> prompts
def image_bytes(item: Any) -> bytes | None:
    """The encoded bytes of one `images` entry: an {"bytes", "path"} struct (parquet, or `datasets` with
    decoding off; without bytes, `path` is read when it is a local file of at most MAX_IMAGE_BYTES),
    raw bytes, or a decoded PIL image (re-encoded as PNG); None when there are none."""
    if isinstance(item, Mapping):
        path = item.get("path")
        item = item.get("bytes")
        if item is None and isinstance(path, str) and path and Path(path).is_file():
            return Path(path).read_bytes() if Path(path).stat().st_size <= MAX_IMAGE_BYTES else None
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    if hasattr(item, "save") and hasattr(item, "size"):  # a PIL image (datasets' default decoding)
        buf = io.BytesIO()
        item.save(buf, format="PNG")
        return buf.getvalue()
    return None


def image_data_url(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> str | SkipReason:
    """`data:<mime>;base64,...` of an encoded image after a full decode (PIL), or why it is unusable
    (`bad_image`: not decodable, or a format outside IMAGE_MIME). The pixel count is checked from the
    header before the pixels are decoded."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        return "image_too_large"
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                return "image_too_large"
            img.load()  # truncated or corrupt pixel data only shows up when decoding
            mime = IMAGE_MIME.get(img.format or "")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return "bad_image"
    if mime is None:
        return "bad_image"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _geo3k_row(
    row: Any, max_images: int, max_pixels: int
) -> tuple[list[dict[str, Any]], str, str] | SkipReason:
    """(content parts, dedup key, ground truth) of a Geometry3K-style row, or why it is unusable."""
    if not isinstance(row, Mapping):
        return "not_a_mapping"
    problem, images = row.get("problem"), row.get("images")
    if not isinstance(problem, str):
        return "bad_prompt"
    if len(problem) > MAX_PROMPT_CHARS:
        return "prompt_too_long"
    try:
        problem.encode("utf-8")
    except UnicodeEncodeError:
        return "prompt_not_utf8"
    if not problem.replace(IMAGE_MARKER, "").strip():
        return "empty_prompt"
    truth = row.get("answer")
    bad = answer_skip_reason(truth)
    if bad is not None:
        return bad
    if not isinstance(images, list | tuple) or not images:
        return "no_image"
    if len(images) > max_images:
        return "too_many_images"
    pieces = problem.split(IMAGE_MARKER)
    if len(pieces) > 1 and len(pieces) - 1 != len(images):
        return "image_marker_mismatch"
    if len(pieces) == 1:  # no marker: the images come first (the usual VLM convention)
        pieces = [""] * len(images) + pieces
    urls, digests = [], []
    for item in images:
        data = image_bytes(item)
        url = "bad_image" if data is None else image_data_url(data, max_pixels)
        if not url.startswith("data:"):
            return url  # type: ignore[return-value]  (a SkipReason)
        urls.append(url)
        digests.append(hashlib.sha1(data).hexdigest())
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
        if i < len(urls):
            parts.append({"type": "image_url", "image_url": {"url": urls[i]}})
    if parts[-1]["type"] == "text":
        parts[-1]["text"] += GEO_SUFFIX
    else:
        parts.append({"type": "text", "text": GEO_SUFFIX.strip()})
    # Many Geometry3K problems share their text ("Find x."): the images tell them apart.
    return parts, "\0".join([problem.strip(), *digests]), truth


def records_from_geo3k_rows(
    rows: Iterable[Any],
    default_source: str,
    uid_prefix: str,
    *,
    skipped: Counter | None = None,
    max_images: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> list[Prompt]:
    """Geometry3K-style rows -> image+text `Prompt`s (see the module docstring), deduplicated by problem
    text and image bytes (first kept); malformed rows are skipped and counted by reason into `skipped`."""
    out, seen, bad = [], set(), Counter()
    n_rows = 0
    for row in rows:
        n_rows += 1
        parsed = _geo3k_row(row, max_images, max_image_pixels)
        if isinstance(parsed, str):
            bad[parsed] += 1
            continue
        parts, key, truth = parsed
        if key in seen:
            continue
        seen.add(key)
        source = row.get("data_source")
        source = source if isinstance(source, str) and source else default_source
        out.append(Prompt(prompt_uid(uid_prefix, key), [{"role": "user", "content": parts}], truth, source))
    log_skipped(uid_prefix, bad, n_rows, skipped)
    return out


# --------------------------------------------------------------------------- the generator
# Pythagorean triples with hypotenuse <= 100 (every multiple of a primitive one), legs in both orders.
_TRIPLES = sorted(
    {(k * a, k * b, k * c) for a, b, c in [(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29),
                                           (12, 35, 37), (9, 40, 41), (28, 45, 53), (11, 60, 61),
                                           (16, 63, 65), (33, 56, 65), (48, 55, 73), (13, 84, 85),
                                           (36, 77, 85), (39, 80, 89), (65, 72, 97)]
     for k in range(1, 101) if k * c <= 100}
)  # fmt: skip
_TRIPLES = _TRIPLES + [(b, a, c) for a, b, c in _TRIPLES]
_COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (30, 160, 60)}
_BAR_COLOURS = ((70, 110, 200), (220, 120, 40), (60, 160, 90), (160, 70, 170))


def _split_of(kind: str, params: tuple) -> GeoSplit:
    return "test" if zlib.crc32(f"{kind}:{params}".encode()) % TEST_MODULUS == 0 else "train"


def _sample_params(kind: Kind, rng: np.random.Generator) -> tuple:
    """The numbers a problem is about (they decide its split and answer); layouts are drawn later."""
    if kind == "hypotenuse":
        return _TRIPLES[int(rng.integers(len(_TRIPLES)))]
    if kind == "triangle_area":
        a, b = (int(v) for v in rng.integers(2, 31, size=2))
        return (a, b + (a * b) % 2)  # an even product: the area a*b/2 is an integer
    if kind in ("rect_perimeter", "rect_area"):
        hi = 41 if kind == "rect_perimeter" else 21
        return tuple(int(v) for v in rng.integers(2, hi, size=2))
    if kind == "count_dots":
        target, other = (str(c) for c in rng.choice(list(_COLOURS), size=2, replace=False))
        return (int(rng.integers(1, 10)), target, int(rng.integers(0, 6)), other)
    values = tuple(int(v) for v in rng.integers(1, 10, size=4))
    return (*values, int(rng.integers(4)))  # bar_value: four bar heights, the asked bar


def _label(draw: Any, font: Any, xy: tuple[float, float], text: str, size: int) -> None:
    """`text` centred on `xy`, kept inside the image."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    w, h = x1 - x0, y1 - y0
    x = min(max(xy[0] - w / 2, 1), size - w - 1)
    y = min(max(xy[1] - h / 2, 1), size - h - 1)
    draw.text((round(x - x0), round(y - y0)), text, fill=(0, 0, 0), font=font)


def _draw(kind: Kind, params: tuple, rng: np.random.Generator, size: int) -> tuple[Any, str, int, tuple]:
    """(PIL image, problem text, integer answer, layout) of one problem; `layout` holds the random
    choices of the picture (with `params` it identifies the image)."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw, font = ImageDraw.Draw(img), ImageFont.load_default_imagefont()
    margin, span = size // 6, size - 2 * (size // 6)
    if kind in ("hypotenuse", "triangle_area"):
        a, b = params[:2]
        scale = span / max(a, b)
        pa, pb = max(a * scale, size / 8), max(b * scale, size / 8)
        flip_x, flip_y = (int(v) for v in rng.integers(2, size=2))
        fx = (lambda x: size - 1 - x) if flip_x else (lambda x: x)
        fy = (lambda y: size - 1 - y) if flip_y else (lambda y: y)
        r = (fx(margin), fy(size - margin))  # the right angle
        pt_a, pt_b = (fx(margin + pa), r[1]), (r[0], fy(size - margin - pb))
        draw.polygon([r, pt_a, pt_b], outline=(0, 0, 0))
        sx, sy = (1 if pt_a[0] > r[0] else -1), (1 if pt_b[1] > r[1] else -1)
        tick = size / 16  # the right-angle square
        draw.line([(r[0] + sx * tick, r[1]), (r[0] + sx * tick, r[1] + sy * tick), (r[0], r[1] + sy * tick)],
                  fill=(0, 0, 0))  # fmt: skip
        gap = size / 12  # labels sit outside the triangle, off each leg's midpoint
        _label(draw, font, ((r[0] + pt_a[0]) / 2, r[1] - sy * gap), str(a), size)
        _label(draw, font, (r[0] - sx * gap, (r[1] + pt_b[1]) / 2), str(b), size)
        if kind == "hypotenuse":
            mid = ((pt_a[0] + pt_b[0]) / 2 + sx * gap / 2, (pt_a[1] + pt_b[1]) / 2 + sy * gap / 2)
            _label(draw, font, mid, "?", size)
            question, answer = "Find the length of the hypotenuse of the right triangle.", params[2]
        else:
            question, answer = "Find the area of the right triangle.", a * b // 2
        return img, f"{IMAGE_MARKER}{question}", answer, (flip_x, flip_y)
    if kind in ("rect_perimeter", "rect_area"):
        w, h = params
        scale = span / max(w, h)
        pw, ph = max(w * scale, size / 8), max(h * scale, size / 8)
        dx, dy = (int(v) for v in rng.integers(-size // 24, size // 24 + 1, size=2))
        top, left = (int(v) for v in rng.integers(2, size=2))  # which sides carry the labels
        x0, y0 = (size - pw) / 2 + dx, (size - ph) / 2 + dy
        draw.rectangle([x0, y0, x0 + pw, y0 + ph], outline=(0, 0, 0))
        gap = size / 14
        _label(draw, font, (x0 + pw / 2, y0 - gap if top else y0 + ph + gap), str(w), size)
        _label(draw, font, (x0 - gap - 3 if left else x0 + pw + gap + 3, y0 + ph / 2), str(h), size)
        what, answer = ("perimeter", 2 * (w + h)) if kind == "rect_perimeter" else ("area", w * h)
        return img, f"{IMAGE_MARKER}Find the {what} of the rectangle.", answer, (dx, dy, top, left)
    if kind == "count_dots":
        n, colour, n_other, other = params
        cells = 7  # dots sit in distinct cells of a 7 x 7 grid, jittered inside their cell
        chosen = rng.choice(cells * cells, size=n + n_other, replace=False)
        jitter = rng.integers(-2, 3, size=(n + n_other, 2))
        pitch, radius = size / cells, max(2, size // 24)
        for i, (cell, (jx, jy)) in enumerate(zip(chosen.tolist(), jitter.tolist())):
            cx, cy = (cell % cells + 0.5) * pitch + jx, (cell // cells + 0.5) * pitch + jy
            fill = _COLOURS[colour if i < n else other]
            draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
        return img, f"{IMAGE_MARKER}How many {colour} dots are there?", n, tuple(chosen.tolist())
    *values, asked = params  # bar_value
    x_axis, base, top = size / 5, size - size / 7, size / 12
    unit = (base - top) / 10
    for v in range(1, 11):  # light grid lines at every unit, numbered at even ones
        draw.line([(x_axis, base - v * unit), (size - 2, base - v * unit)], fill=(215, 215, 215))
        if v % 2 == 0:
            _label(draw, font, (x_axis / 2, base - v * unit), str(v), size)
    _label(draw, font, (x_axis / 2, base), "0", size)
    draw.line([(x_axis, top), (x_axis, base), (size - 2, base)], fill=(0, 0, 0))
    slot = (size - 2 - x_axis) / 4
    palette = int(rng.integers(len(_BAR_COLOURS)))
    for i, v in enumerate(values):
        x = x_axis + i * slot + slot * 0.2
        draw.rectangle([x, base - v * unit, x + slot * 0.6, base], fill=_BAR_COLOURS[(palette + i) % 4])
        _label(draw, font, (x + slot * 0.3, base + size / 14), "ABCD"[i], size)
    return img, f"{IMAGE_MARKER}What is the value of bar {'ABCD'[asked]}?", values[asked], (palette,)


def generate_split(split: GeoSplit, n: int, seed: int = 0, size: int = 96) -> list[dict[str, Any]]:
    """`n` Geometry3K-style rows of `split`, the kinds in turn; distinct pictures, parameters disjoint
    from the other split's. Deterministic in (split, n, seed, size)."""
    return [row for _, _, row in _generate(split, n, seed, size)]


def _generate(split: GeoSplit, n: int, seed: int, size: int) -> list[tuple[Kind, tuple, dict[str, Any]]]:
    """(kind, params, row) for each of generate_split's rows."""
    from PIL import Image

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0 or not 48 <= size <= 512:
        raise ValueError(f"need n >= 0 and 48 <= size <= 512 (pixels), got n={n}, size={size}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out, seen = [], set()
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        for _ in range(10_000):  # rejection: the other split's numbers, or a picture already drawn
            params = _sample_params(kind, rng)
            if _split_of(kind, params) != split:
                continue
            img, problem, answer, layout = _draw(kind, params, rng, size)
            if (kind, params, layout) not in seen:
                break
        else:
            raise ValueError(f"could not draw {n} distinct {split} problems; lower n or raise size")
        seen.add((kind, params, layout))
        buf = io.BytesIO()
        # Palette PNG: lossless (a diagram has fewer than 16 colours: no antialiasing, a bitmap font)
        # and ~1.6x smaller than RGB; deterministic (no metadata, no timestamps).
        img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(buf, format="PNG", optimize=True)
        row = {"images": [{"bytes": buf.getvalue(), "path": None}], "problem": problem, "answer": str(answer)}
        out.append((kind, params, row))
    return out


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Rows as a parquet file with the hub's schema, including the `datasets` feature metadata, so that
    `datasets.load_dataset` reads the images as Image features exactly as it does the hub's."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
    })  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=features.arrow_schema), path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic geo_vision dataset (Geometry3K format).")
    ap.add_argument("--out", default="data/geo_vision", help="directory for train.parquet and test.parquet")
    ap.add_argument("--num-train", type=int, default=1000)
    ap.add_argument("--num-test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=96, help="image side in pixels")
    args = ap.parse_args(argv)
    for split, n in (("train", args.num_train), ("test", args.num_test)):
        path = Path(args.out) / f"{split}.parquet"
        write_parquet(generate_split(split, n, seed=args.seed, size=args.size), path)
        print(f"wrote {n} {split} rows to {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
