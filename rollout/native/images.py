"""Image features for the native engine: a bounded cache of tower outputs and per-chunk slicing.

What: `ImageFeatureCache(vision, max_rows)` runs the tower once per distinct image (an LRU keyed by
content, bounded in feature rows) and `RequestImages.span(start, stop)` gives the rows a prefill chunk
takes, so a chunk may end inside an image. Invariants: features are computed once per request and
image; a request's rows are dropped once all its samples have cached their placeholders.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.vision.preprocess import ProcessedImage
from model.vision.tower import VisionModel

# Design notes (moved from the module docstring)
# What: `ImageFeatureCache(vision, max_rows)` turns a request's `ProcessedImage`s into text-width
# feature rows. An image already seen (same sha256 and patch grid) is served from an LRU cache bounded
# by feature rows (one row per image token, so the bound is memory: rows x hidden x dtype bytes); all
# misses of a step go through the tower in one `VisionModel.encode_images` call. `RequestImages` is
# one request's side: its images, the prompt positions of their placeholder tokens (ascending) and,
# while the request is in flight, its concatenated features; `span(start, stop)` gives the feature
# rows that prompt positions [start, stop) take, so a prefill chunk may end inside an image.
#
# Why here and not in the model: features are computed once per request (and once per distinct
# image across requests), not once per prefill chunk, preemption or group sibling; the model's
# `forward_cached` only receives the rows of its own tokens.
#
# Invariants: features of an image do not depend on the batch (the tower attends within one image),
# so a cached row equals a fresh one; when the features depend on the adapter (a projector LoRA,
# model/vision/lora.py) the engine calls `clear()` on every adapter change. Cached tensors are
# copies, never views into a larger batch output, so the row bound is the memory actually held.
#
# Legend: N feature rows (image tokens), D text hidden.


@dataclass
class RequestImages:
    """One request's images; `features_NE` is filled on the first chunk that needs it and dropped
    when the request's last sample finishes (or the adapter changes the features)."""

    images: tuple[ProcessedImage, ...]
    positions: list[int]  # prompt positions of the image placeholder tokens, ascending
    features_NE: torch.Tensor | None = None

    @classmethod
    def of(cls, prompt_ids: tuple[int, ...], images: tuple[ProcessedImage, ...], image_token_id: int):
        return cls(images, [i for i, t in enumerate(prompt_ids) if t == image_token_id])

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """Feature rows [a, b) for the placeholders among positions [start, stop)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, stop)


class ImageFeatureCache:
    """LRU of per-image features keyed by (sha256, grid), bounded by `max_rows` rows in all."""

    def __init__(self, vision: VisionModel, max_rows: int):
        if max_rows < 0:
            raise ValueError(f"image cache size must be >= 0 rows, got {max_rows}")
        self.vision, self.max_rows = vision, max_rows
        self._lru: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.num_rows = 0
        self.encoded = 0  # distinct images run through the tower
        self.hits = 0  # images served from the cache

    def clear(self) -> None:
        self._lru.clear()
        self.num_rows = 0

    def fill(self, requests: list[RequestImages]) -> None:
        """Set `features_NE` of every request lacking it, with one tower call for all misses."""
        todo = [r for r in requests if r.features_NE is None]
        if not todo:
            return
        per_image = self.features([im for r in todo for im in r.images])
        k = 0
        for r in todo:
            n = len(r.images)
            r.features_NE = torch.cat(per_image[k : k + n])
            k += n

    def features(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """[n_i, D] per image, in order."""
        out: list[torch.Tensor | None] = [None] * len(images)
        miss: dict[tuple, list[int]] = {}
        for i, im in enumerate(images):
            key = (im.sha256, tuple(im.grid_thw))
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                out[i] = hit
            else:
                miss.setdefault(key, []).append(i)
        if miss:
            fresh = self.vision.encode_images([images[idx[0]] for idx in miss.values()])
            for (key, idx), f_NE in zip(miss.items(), fresh):
                self.encoded += 1
                self.hits += len(idx) - 1  # repeats within this call reuse the one encoding
                f_NE = f_NE.clone()  # not a view: the cache holds exactly what it counts
                for i in idx:
                    out[i] = f_NE
                self._put(key, f_NE)
        return out

    def _put(self, key: tuple, f_NE: torch.Tensor) -> None:
        n = f_NE.shape[0]
        if n > self.max_rows:
            return  # larger than the whole cache: used by its request only
        while self.num_rows + n > self.max_rows:
            _, old = self._lru.popitem(last=False)
            self.num_rows -= old.shape[0]
        self._lru[key] = f_NE
        self.num_rows += n
