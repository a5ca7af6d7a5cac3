"""Checkpoints that a crashed run resumes from exactly.

A checkpoint is `output_dir/checkpoint-<step>/`: the policy in HF `save_pretrained` format (loadable by
any later stage), the tokenizer, and `trainer_state.pt` with optimizer, scheduler, RNG states and the
training position. It is written to a temporary directory and renamed; then `output_dir/latest` (a
one-line file naming the newest complete checkpoint) is replaced atomically. A crash at any moment leaves
`latest` pointing at a complete checkpoint.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

from data.manifest import MANIFEST, atomic_dir, code_version, sha256_dir, write_json_atomic

LATEST = "latest"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, trainer_state: dict, manifest: dict,
                    keep: int) -> Path:
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer_state.pt")
        write_json_atomic(tmp / MANIFEST, {**manifest, "kind": "checkpoint", "step": step,
                                           "code_version": code_version(), "sha256": sha256_dir(tmp)})
    tmp_latest = output_dir / f".{LATEST}.tmp-{os.getpid()}"
    tmp_latest.write_text(final.name + "\n")
    os.replace(tmp_latest, output_dir / LATEST)
    _prune(output_dir, keep, final)
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(output_dir) / pointer.read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing; remove "
                                f"{pointer} to start over")
    return path


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False)


def _prune(output_dir: Path, keep: int, newest: Path) -> None:
    steps = sorted((int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)))
    for _, path in steps[:-keep] if keep > 0 else []:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)
