"""Vision inputs for the M3 family: config, image preprocessing, tower + projector, weights, chat.

See each module's docstring; the names below are the public API.
"""

from model.vision.chat import ChatInputs, chat_to_ids_and_images, check_placeholders, placeholder_ids
from model.vision.config import VISION_TOP_LEVEL_KEYS, VisionConfig
from model.vision.lora import apply_projector_lora
from model.vision.preprocess import ImageInputError, ProcessedImage, load_images, preprocess_image
from model.vision.tower import VisionModel, merge_image_features
from model.vision.weights import (
    VisionWeightError,
    load_vision_checkpoint,
    load_vision_weights,
    vision_state_for_save,
)

__all__ = [
    "VISION_TOP_LEVEL_KEYS",
    "ChatInputs",
    "ImageInputError",
    "ProcessedImage",
    "VisionConfig",
    "VisionModel",
    "VisionWeightError",
    "apply_projector_lora",
    "chat_to_ids_and_images",
    "check_placeholders",
    "load_images",
    "load_vision_checkpoint",
    "load_vision_weights",
    "merge_image_features",
    "placeholder_ids",
    "preprocess_image",
    "vision_state_for_save",
]
