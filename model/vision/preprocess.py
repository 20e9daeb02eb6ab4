"""Image inputs: OpenAI-style content parts -> checked, decoded, resized, normalised patch rows.

What: `image_bytes_from_part` reads the bytes an `image_url` part points at (a base64 data URL, a
`file://` URL or a local path; http(s) is refused: the machines have no network); `preprocess_image`
decodes them with PIL into what the tower consumes: pixel_values [P, C*T*p*p] fp32 (one row per 14x14
patch, merge-block-major), the grid (1, H/p, W/p) and the token count P / merge^2. Numerics follow
upstream's image processor (smart_resize, antialiased bicubic on uint8, CLIP normalisation).

Invariants: every limit is checked before the expensive step it protects (encoded size before base64
decoding or reading a file, declared width x height before decoding pixels, the image count before
any image is touched); malformed input raises `ImageInputError` (a ValueError) naming the part, the
fault and the fix.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
import torch.nn.functional as F

from model.vision.config import VisionConfig

# Rows: the 2x2 patches that become one text token are consecutive; each row is laid out
# (channel, frame, y, x) with the single frame repeated T = temporal_patch_size times.
# smart_resize keeps the aspect ratio, makes both sides multiples of patch x merge (28) and keeps the
# area in [min_pixels, max_pixels]; resampling is antialiased bicubic on the uint8 values rounded back
# to uint8 (transformers' torchvision backend; here `torch.nn.functional.interpolate`, torchvision is
# not installed); then x / 255 and (x - mean) / std per channel. Limits: `max_image_bytes`,
# `max_source_pixels` (from the header), `max_images_per_request`.

try:
    from PIL import Image, UnidentifiedImageError
except ImportError as e:  # pragma: no cover - pillow ships with the venv (via matplotlib)
    raise ImportError("model.vision.preprocess needs Pillow: pip install pillow") from e

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_ASPECT_RATIO = 200  # upstream's smart_resize rejects longer strips


class ImageInputError(ValueError):
    """An image content part that cannot be used: malformed, unsupported, too large or too many."""


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the tower. `sha256` hashes the encoded bytes: a cache key for features.
    Equality and hashing go by (grid, tokens, size, sha256), never by comparing pixel tensors."""

    pixel_values: torch.Tensor = field(compare=False)  # fp32 [P, C*T*p*p]
    grid_thw: tuple[int, int, int]  # (frames/T, rows of patches, columns of patches)
    num_tokens: int  # placeholder tokens it fills: P / merge^2
    source_size: tuple[int, int]  # (width, height) as decoded
    sha256: str


# ------------------------------------------------------------------------------- sizes
def smart_resize(height: int, width: int, config: VisionConfig) -> tuple[int, int]:
    """(height, width) -> resized (height, width): multiples of patch x merge, area within
    [min_pixels, max_pixels], aspect ratio kept as closely as the rounding allows."""
    if height <= 0 or width <= 0:
        raise ImageInputError(f"image has an empty side ({width}x{height} pixels)")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageInputError(
            f"image aspect ratio {ratio:.1f} ({width}x{height}) exceeds {MAX_ASPECT_RATIO}; crop or pad it"
        )
    f = config.resize_factor
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def num_image_tokens(height: int, width: int, config: VisionConfig) -> int:
    """Placeholder tokens an image of this source size occupies."""
    h, w = smart_resize(height, width, config)
    return (h // config.patch_size) * (w // config.patch_size) // config.merge_unit


# ------------------------------------------------------------------------------- reading parts
def image_url_of(part: Mapping[str, Any], where: str = "content part") -> str:
    """The URL string of an OpenAI `image_url` part ({"type": "image_url", "image_url": {"url": u}};
    a bare string for "image_url" is accepted too)."""
    if not isinstance(part, Mapping) or part.get("type") != "image_url":
        raise ImageInputError(f"{where}: expected {{'type': 'image_url', 'image_url': {{'url': ...}}}}")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str) or not url:
        raise ImageInputError(f"{where}: image_url.url must be a non-empty string, got {type(url).__name__}")
    return url


def image_bytes_from_part(
    part: Mapping[str, Any], config: VisionConfig, where: str = "content part"
) -> bytes:
    """Encoded image bytes from a data URL, a file:// URL or a local path (size-checked first)."""
    url = image_url_of(part, where)
    limit = config.max_image_bytes
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageInputError(
                f"{where}: a data URL must look like 'data:image/png;base64,<payload>', got {url[:40]!r}..."
            )
        if not header[5:].startswith("image/"):
            raise ImageInputError(f"{where}: data URL media type {header[5:-7]!r} is not an image/* type")
        # 4 base64 characters carry 3 bytes: refuse before decoding anything large.
        if len(payload) // 4 * 3 > limit + 3:
            raise ImageInputError(
                f"{where}: encoded image of about {len(payload) // 4 * 3} bytes exceeds "
                f"max_image_bytes={limit}"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageInputError(f"{where}: the data URL payload is not valid base64 ({e})") from e
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp"):
        raise ImageInputError(
            f"{where}: {scheme} image URLs are not fetched (no network access here); send the image "
            "inline as 'data:image/png;base64,...' or as a local file path"
        )
    if scheme == "file":
        path = Path(unquote(urlparse(url).path))
    elif scheme == "":
        path = Path(url)
    else:
        raise ImageInputError(
            f"{where}: unsupported image URL scheme {scheme!r}; use a data URL, file:// URL or local path"
        )
    if not path.is_file():
        raise ImageInputError(f"{where}: image file {str(path)!r} does not exist or is not a file")
    size = path.stat().st_size
    if size > limit:
        raise ImageInputError(f"{where}: image file {str(path)!r} has {size} bytes > max_image_bytes={limit}")
    return path.read_bytes()


# ------------------------------------------------------------------------------- decoding
def decode_image(data: bytes, config: VisionConfig, where: str = "image") -> Image.Image:
    """Encoded bytes -> RGB PIL image; checks format, declared size and completeness."""
    if len(data) > config.max_image_bytes:
        raise ImageInputError(
            f"{where}: {len(data)} encoded bytes > max_image_bytes={config.max_image_bytes}"
        )
    if not data:
        raise ImageInputError(f"{where}: empty image data")
    try:
        with warnings.catch_warnings():
            # Our max_source_pixels check replaces PIL's decompression-bomb warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ImageInputError(
            f"{where}: not a decodable image ({type(e).__name__}: {e}); supported formats: "
            f"{list(SUPPORTED_FORMATS)}"
        ) from e
    if img.format not in SUPPORTED_FORMATS:
        raise ImageInputError(
            f"{where}: format {img.format} is not supported; use one of {list(SUPPORTED_FORMATS)}"
        )
    w, h = img.size
    if w * h > config.max_source_pixels:
        raise ImageInputError(
            f"{where}: {w}x{h} = {w * h} pixels exceeds max_source_pixels={config.max_source_pixels}; "
            "downscale the image before sending it"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()  # decodes every pixel: truncated / corrupt data fails here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageInputError(f"{where}: image data is truncated or corrupt ({type(e).__name__}: {e})") from e
    return img if img.mode == "RGB" else img.convert("RGB")


# ------------------------------------------------------------------------------- tensors
def resize_uint8(img_CHW: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bicubic resize of uint8 [C, H, W] values, rounded back to uint8 levels (fp32)."""
    if tuple(img_CHW.shape[-2:]) == (height, width):
        return img_CHW.float()
    out = F.interpolate(
        img_CHW.float()[None], size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )[0]
    return out.round().clamp(0, 255)


def patchify(x_CHW: torch.Tensor, config: VisionConfig) -> torch.Tensor:
    """Normalised [C, H, W] (H, W multiples of patch x merge) -> [P, C*T*p*p] rows, merge-block-major."""
    C, H, W = x_CHW.shape
    p, m, T = config.patch_size, config.spatial_merge_size, config.temporal_patch_size
    gh, gw = H // p, W // p
    # [C, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m(row), m(col), C, p(y), p(x)]
    x = x_CHW.reshape(C, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    # One still image fills all T frames of the temporal patch: [..., C, T, p, p].
    x = x.unsqueeze(5).expand(gh // m, gw // m, m, m, C, T, p, p)
    return x.reshape(gh * gw, C * T * p * p)


def preprocess_image(
    image: Image.Image | bytes, config: VisionConfig, where: str = "image"
) -> ProcessedImage:
    """Decoded (or encoded) image -> ProcessedImage (layout: module notes)."""
    data = image if isinstance(image, bytes | bytearray) else None
    if data is not None:
        image = decode_image(bytes(data), config, where)
    elif image.mode != "RGB":
        image = image.convert("RGB")
    digest = hashlib.sha256(data if data is not None else image.tobytes()).hexdigest()
    w, h = image.size
    if config.num_channels != 3:
        raise ImageInputError(
            f"{where}: only 3-channel (RGB) towers are supported, config has {config.num_channels}"
        )
    rh, rw = smart_resize(h, w, config)
    img_HWC = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(h, w, 3)
    x_CHW = resize_uint8(img_HWC.permute(2, 0, 1), rh, rw) / 255.0
    mean = torch.tensor(config.image_mean).view(-1, 1, 1)
    std = torch.tensor(config.image_std).view(-1, 1, 1)
    x_CHW = (x_CHW - mean) / std
    pixel_values = patchify(x_CHW, config)
    grid = (1, rh // config.patch_size, rw // config.patch_size)
    return ProcessedImage(pixel_values, grid, grid[1] * grid[2] // config.merge_unit, (w, h), digest)


def check_image_count(n: int, config: VisionConfig) -> None:
    if n > config.max_images_per_request:
        raise ImageInputError(
            f"request has {n} images; max_images_per_request={config.max_images_per_request}. Send fewer "
            "images or raise the limit in the vision config"
        )


def load_images(parts: Sequence[Mapping[str, Any]], config: VisionConfig) -> list[ProcessedImage]:
    """Every `image_url` part of one request, in order (count checked before any is read)."""
    check_image_count(len(parts), config)
    out = []
    for i, part in enumerate(parts):
        where = f"image {i}"
        out.append(preprocess_image(image_bytes_from_part(part, config, where), config, where))
    return out
