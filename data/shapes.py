"""Synthetic CLEVR-like counting images, drawn with PIL: the embedded vision demo's data, made here because no
dataset hub is reachable.

Each image has 1-`max_count` simple shapes (circle, square, triangle) of a few colours and sizes on a plain
background, one per cell of a grid (so they never overlap); the row asks how many there are. Everything is
seeded: the same seed and index give the same image, byte for byte. The held-out pool is drawn from its own
seed stream, so a warm-up on the training pool never sees a held-out image.

`write_counting_source(directory, n, seed, split)` writes PNGs and a `counting.jsonl` in the R1-V /
CLEVR-70k-Counting layout (`image`, `problem`, `solution: "<answer> N </answer>"`), which
`grpoflow prep --task counting` reads like any other source.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLORS = {"red": (220, 50, 50), "green": (40, 170, 70), "blue": (50, 90, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "How many objects are there in the image?"
SPLIT_SEED = {"train": 0, "heldout": 1}


def draw_counting_image(count: int, rng: random.Random, size: int = 56, cell: int = 14):
    """An RGB image of `count` shapes, each in its own `cell` x `cell` square of a grid (a vision patch, for
    the tiny model: 14 pixels), centred with a pixel of jitter; `rng` decides cells, shapes, colours and
    sizes."""
    from PIL import Image, ImageDraw

    cells = [(x, y) for y in range(0, size - cell + 1, cell) for x in range(0, size - cell + 1, cell)]
    if count > len(cells):
        raise ValueError(f"{count} shapes do not fit in a {size}x{size} image of {cell}-pixel cells")
    image = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for x0, y0 in rng.sample(cells, count):
        r = rng.choice((cell // 4, cell * 3 // 7))  # two sizes
        cx, cy = x0 + cell // 2 + rng.randint(-1, 1), y0 + cell // 2 + rng.randint(-1, 1)
        box = (cx - r, cy - r, cx + r, cy + r)
        color = COLORS[rng.choice(sorted(COLORS))]
        shape = rng.choice(SHAPES)
        if shape == "circle":
            draw.ellipse(box, fill=color)
        elif shape == "square":
            draw.rectangle(box, fill=color)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), (cx, box[1])], fill=color)
    return image


def counting_examples(n: int, seed: int, split: str = "train", max_count: int = 6, size: int = 56):
    """`n` (image, count) pairs of one pool, seeded; counts 1..max_count, each equally likely."""
    rng = random.Random(seed * 1_000_003 + SPLIT_SEED[split])
    for _ in range(n):
        count = rng.randint(1, max_count)
        yield draw_counting_image(count, rng, size), count


def write_counting_source(
    directory: str | Path, n: int, seed: int = 0, split: str = "train", max_count: int = 6, size: int = 56
) -> Path:
    """Write `n` images and `counting.jsonl` (R1-V layout, images relative to it) into `directory`."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, count) in enumerate(counting_examples(n, seed, split, max_count, size)):
        name = f"images/{split}-{i:05d}.png"
        image.save(directory / name, format="PNG")
        lines.append(
            json.dumps({"image": name, "problem": QUESTION, "solution": f"<answer> {count} </answer>"})
        )
    path = directory / "counting.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


__all__ = ["QUESTION", "counting_examples", "draw_counting_image", "write_counting_source"]
