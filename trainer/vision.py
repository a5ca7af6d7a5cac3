"""Images in prompts, from prepared rows to a forward: the one place that knows how an image reaches a model.

- `VisionEncoder` (attached by `model_loading.load_model` to a vision model's tokenizer as `tokenizer.vision`)
  turns a row's images into what the model takes: pixel patches and their grid from the image processor
  (its PIL backend: the torchvision one is not importable beside a CPU torch), and the prompt's image
  placeholders, one `<|vision_start|><|image_pad|><|vision_end|>` per image before the user's text, with each
  `<|image_pad|>` expanded to the number of patches / merge_size**2, as the model's own processor does.
- `PromptIds` is a prompt's token ids (a plain list, so every text path keeps working) that also carries its
  `VisionInputs`; it survives pickling to rollout workers.
- `vision_forward_kwargs` gives a forward the pixel values, grids, modality types and the 3-D (M-RoPE)
  positions, computed by the model's own `get_rope_index` over the left-padded batch. The same function serves
  the rollout prefill and the training forward, so both see exactly the same vision inputs and positions.

Models: the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): `AutoModelForImageTextToText` whose inner model has
`get_rope_index`. Videos and audio are refused with the row named (no processor for them is wired here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from data.images import load_image

PLACEHOLDER_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
UNSUPPORTED_MEDIA = ("videos", "audios")


@dataclass
class VisionInputs:
    """The images of one prompt (or of several, concatenated in row order), as the model takes them."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: torch.Tensor  # [images, 3]
    image_token_id: int
    refs: tuple[str, ...] = ()  # the prepared image references (for engines that take the images themselves)

    @staticmethod
    def concat(items: list[VisionInputs | None]) -> VisionInputs | None:
        present = [v for v in items if v is not None]
        if not present:
            return None
        return VisionInputs(
            torch.cat([v.pixel_values for v in present]),
            torch.cat([v.image_grid_thw for v in present]),
            present[0].image_token_id,
            tuple(r for v in present for r in v.refs),
        )

    def to(self, device) -> VisionInputs:
        return dataclasses.replace(
            self, pixel_values=self.pixel_values.to(device), image_grid_thw=self.image_grid_thw.to(device)
        )


class PromptIds(list):
    """A prompt's token ids; `vision` holds what its image placeholders stand for (None for a text prompt)."""

    def __init__(self, ids=(), vision: VisionInputs | None = None):
        super().__init__(ids)
        self.vision = vision

    def __reduce__(self):
        return PromptIds, (list(self), self.vision)


def vision_of(prompt) -> VisionInputs | None:
    return getattr(prompt, "vision", None)


class VisionEncoder:
    """A vision model's image processor and image placeholder tokens."""

    def __init__(self, image_processor, tokenizer, model_config):
        self.image_processor = image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.image_token_id = int(model_config.image_token_id)
        self.placeholder = "".join(PLACEHOLDER_TOKENS)
        ids = tokenizer.convert_tokens_to_ids(list(PLACEHOLDER_TOKENS))
        if ids[1] != self.image_token_id:
            raise ValueError(
                f"the tokenizer's {PLACEHOLDER_TOKENS[1]} is id {ids[1]}, but the model's config says "
                f"image_token_id {self.image_token_id}: tokenizer and model do not belong together"
            )

    def inputs(self, refs: list[str]) -> VisionInputs:
        images = [load_image(r) for r in refs]
        out = self.image_processor(images=images, return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"], self.image_token_id, tuple(refs))

    def encode(self, tokenizer, row: dict) -> PromptIds:
        """The chat-templated prompt of `row` with its images: placeholders expanded, vision inputs
        attached."""
        vision = self.inputs(list(row["images"]))
        messages = [dict(m) for m in row["prompt"]]
        user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[user]["content"] = self.placeholder * len(row["images"]) + messages[user]["content"]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sizes = iter((vision.image_grid_thw.prod(-1) // self.merge**2).tolist())
        expanded = []
        for token in ids:
            expanded.extend([token] * next(sizes) if token == self.image_token_id else [token])
        return PromptIds(expanded, vision)


def check_media(row: dict, vision: VisionEncoder | None) -> None:
    """ValueError naming the row when it carries media this model cannot take."""
    for key in UNSUPPORTED_MEDIA:
        if row.get(key):
            raise ValueError(
                f"row {row.get('id')!r}: it has {key}, which this trainer cannot give a model yet "
                "(images only); drop the column or the rows"
            )
    if row.get("images") and vision is None:
        raise ValueError(
            f"row {row.get('id')!r}: it has images, but the model was loaded without an image "
            "processor: set model.modality: vision and use an image-text model (e.g. Qwen2.5-VL)"
        )


def vision_forward_kwargs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionInputs
) -> dict:
    """What a forward over left-padded `input_ids` needs besides ids and mask: pixels, grids, modality types
    and 3-D positions (padding at 0), computed once here so that rollout and training agree."""
    vision = vision.to(input_ids.device)
    types = (input_ids == vision.image_token_id).int()
    core = getattr(model, "module", model)  # DDP
    positions, _ = core.model.get_rope_index(
        input_ids,
        image_grid_thw=vision.image_grid_thw,
        attention_mask=attention_mask,
        mm_token_type_ids=types,
    )
    return {
        "pixel_values": vision.pixel_values,
        "image_grid_thw": vision.image_grid_thw,
        "mm_token_type_ids": types,
        "position_ids": positions,
    }


def save_tokenizer(tokenizer, directory) -> None:
    """The tokenizer, and a vision model's image processor, in `save_pretrained` format."""
    tokenizer.save_pretrained(directory)
    if getattr(tokenizer, "vision", None) is not None:
        tokenizer.vision.image_processor.save_pretrained(directory)


__all__ = [
    "PromptIds",
    "save_tokenizer",
    "VisionEncoder",
    "VisionInputs",
    "check_media",
    "vision_forward_kwargs",
    "vision_of",
]
