"""Checkpoints that a crashed run resumes from exactly, and only when they are intact and compatible.

A checkpoint is `output_dir/checkpoint-<step>/`: the policy in HF `save_pretrained` format (loadable by
any later stage), the tokenizer, `trainer_state.pt` with optimizer, scheduler, RNG states and the
training position, and a `manifest.json` with the sha256 of every file, the recipe and the prepared data's
sha256. It is written to a temporary directory and renamed; then `output_dir/latest` (a one-line file
naming the newest complete checkpoint) is replaced atomically. One that cannot be written (a full disk)
raises `CheckpointWriteError` naming it and leaves nothing of itself behind. `serving_copy` writes what a
served or registered model needs and nothing of the training state.

Resuming (`resume_checkpoint`) takes the newest checkpoint whose files match its manifest. One that does
not (zeroed or truncated weights, a missing file), or a `latest` naming a directory that is gone, is
warned about by name and set aside as `checkpoint-<step>.corrupt` (kept for inspection, never trained
on); the next older intact one is used, or the run starts fresh with a warning when none is left.

A run directory belongs to one training configuration (`config_changes`): resuming it with a recipe that
differs in anything that decides the checkpoint is refused, naming the keys. These may change on resume,
because they say how long, how often or where, not what is trained:
- `train.max_steps`: train longer (or stop earlier, but not before the checkpoint's step); only with
  `train.lr_scheduler_type: constant`, since a linear or cosine schedule is defined by it;
- `train.save_steps`, `train.save_total_limit`: when checkpoints are written and how many are kept;
- `train.callbacks`: observers of training;
- `train.output_dir`: the run directory itself (moved, or spelled differently);
- `rollout.sync_timeout_s`, `rollout.gpu_memory_utilization`: operational limits.
The recipe's `name`, `description`, `eval` and `registry` sections do not decide the checkpoint and are
not compared; progress bars and logging are not part of the recipe.

One run at a time writes a run directory (`claim_run_dir`): the process that trains it (trainer rank 0, or
the launcher of the ranks) holds `output_dir/.lock` from start to end (`data.dir_lock`); a second run on it
is refused naming the holder. Holding it proves that no checkpoint is being written there, so the claim
also removes what a killed writer left: `.checkpoint-<step>.tmp-*` (a checkpoint cut short), `.old-*` (one
being replaced), `.latest.tmp-*`, DeepSpeed's `.zero-state-<step>` staging and the marker below.

Several nodes train in one run directory only when it is one filesystem that every node mounts at the same
path: each trainer rank resumes from what it finds there, and ZeRO stages each rank's shard there.
`check_shared_run_dir` refuses, at start and naming train.output_dir, a directory the ranks do not share.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import random
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from data.dir_lock import Held, exclusive
from data.manifest import (
    MANIFEST,
    IntegrityError,
    atomic_dir,
    code_version,
    combined_sha256,
    file_hashes,
    read_manifest,
    verify_output,
    write_json_atomic,
)
from data.progress import quiet_transformers_progress
from trainer.lora import is_adapter_dir
from trainer.recipe import Recipe
from trainer.typed_config import ConfigError
from trainer.vision import save_tokenizer

LATEST = "latest"
KIND = "checkpoint"
ZERO_DIR = (
    "zero"  # DeepSpeed's optimizer state (one shard per trainer rank) inside a checkpoint trained under ZeRO
)
TRAINER_STATE = "trainer_state.pt"
# What resumes training and serves nothing: left out of `serving_copy` (for a 7B policy with fp32 Adam
# moments, about twice the model's own size)
TRAINING_STATE = (TRAINER_STATE, ZERO_DIR)
# The recipe sections that decide what a checkpoint holds (the pipeline's run-directory fingerprint).
TRAINING_SECTIONS = ("model", "bootstrap", "data", "train", "rollout", "rewards")
RESUMABLE_CHANGES = frozenset(
    {
        "train.max_steps",
        "train.save_steps",
        "train.save_total_limit",
        "train.callbacks",
        "train.output_dir",
        "rollout.sync_timeout_s",
        "rollout.gpu_memory_utilization",
    }
)
_UNSET = object()
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error shows an errno
# What a writer killed mid-checkpoint leaves (`data.manifest.atomic_dir`, `_point_latest`, DeepSpeed's
# staging, the shared-directory check's marker)
_LEFTOVER = re.compile(
    r"^\.(checkpoint-\d+\.(tmp|old)-.+|latest\.tmp-\d+|zero-state-\d+|shared-check-[0-9a-f]{32})$"
)
SHARED_MARKER = ".shared-check-"  # + a fresh hex name: `check_shared_run_dir`'s file
# the ranks reach the shared-directory check together, right after joining their process group: a minute
# is slack, and the check never waits on a rank that is gone for as long as a weight sync may take
SHARED_CHECK_TIMEOUT_S = 60.0
log = logging.getLogger("grpoflow.train")


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


@contextlib.contextmanager
def claim_run_dir(output_dir: str | os.PathLike) -> Iterator[Held | None]:
    """Hold the run directory for a training run (see the module docstring); `DirectoryBusy` (exit 2) names
    the run holding it. Trainer ranks other than 0 (RANK) take nothing: rank 0, or their launcher, holds
    it."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield None
        return
    with exclusive(output_dir, "train.output_dir") as held:
        if held.owner:
            remove_leftovers(Path(output_dir))
        yield held


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Remove the partial writes `_LEFTOVER` names; only while holding the directory (no writer is
    running)."""
    removed = sorted(p for p in output_dir.iterdir() if _LEFTOVER.match(p.name))
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.warning("removed %s: left by a run that stopped while writing a checkpoint", path)
    return removed


def check_shared_run_dir(
    output_dir: Path, rank: int, world: int, timeout_s: float = SHARED_CHECK_TIMEOUT_S, grace_s: float = 2.0
) -> None:
    """Refuse (ConfigError naming train.output_dir) a run directory that the trainer ranks do not share.

    Every rank resumes from the checkpoint it finds there, and under ZeRO each rank stages its optimizer
    shard there for rank 0 to move into the checkpoint: on several nodes it must be one filesystem mounted at
    the same path on each, which nothing else checks (a node-local disk at that path would train, then
    resume each node from its own checkpoints or write checkpoints without the other nodes' shards). Rank 0
    writes a file with a fresh name into it and every rank looks for that name (for up to `grace_s`, for
    filesystems that show a new file late). Collective: every trainer rank calls it right after joining the
    process group; its collectives run on a gloo group of their own, bounded by `timeout_s`."""
    if world <= 1:
        return
    import torch.distributed as dist

    output_dir = Path(output_dir)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        # rank 0's file name, and why it could not write it (told to every rank: none waits for nothing)
        told = [f"{SHARED_MARKER}{uuid.uuid4().hex}", None] if rank == 0 else [None, None]
        if rank == 0:
            try:
                output_dir.mkdir(parents=True, exist_ok=True)
                (output_dir / told[0]).write_text(f"{socket.gethostname()} {os.getpid()}\n")
            except OSError as e:
                told[1] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(told, src=0, group=group)
        marker, deadline = output_dir / told[0], time.monotonic() + grace_s
        while not (seen := marker.is_file()) and told[1] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        answers = [None] * world
        dist.all_gather_object(answers, (socket.gethostname(), str(output_dir), seen), group=group)
    finally:
        if rank == 0:
            (output_dir / told[0]).unlink(missing_ok=True)
        dist.destroy_process_group(group)
    host0, dir0 = answers[0][0], answers[0][1]  # every rank says the same: rank 0's view first
    if told[1] is not None:
        raise ConfigError(f"train.output_dir: trainer rank 0 ({host0}) cannot write in {dir0}: {told[1]}")
    blind = [f"rank {r} ({host}: {path})" for r, (host, path, seen) in enumerate(answers) if not seen]
    if blind:
        raise ConfigError(
            f"train.output_dir {dir0} is not one directory shared by the trainer ranks: rank 0 "
            f"({host0}) wrote {told[0]} there, and {', '.join(blind)} cannot see it. Every rank resumes "
            "from the checkpoints there and stages its ZeRO optimizer shard there: set train.output_dir to "
            "a path on a filesystem every node mounts at the same place (NFS, Lustre, ...)"
        )


class CheckpointWriteError(OSError):
    """Checkpoint `filename` could not be written (a full disk, a file-size limit, ...): nothing of it is
    left and the older checkpoints are untouched. `errno` is the writer's, where it told one."""

    def __init__(self, final: Path, error: Exception):
        code = _errno_of(error)
        super().__init__(code, os.strerror(code) if code else f"{type(error).__name__}: {error}", str(final))

    def __str__(self) -> str:
        return f"cannot write checkpoint {self.filename}: {self.strerror}"


def save_checkpoint(
    output_dir: Path,
    step: int,
    model,
    tokenizer,
    trainer_state: dict,
    manifest: dict,
    keep: int,
    extra: Path | None = None,
) -> Path:
    """Write checkpoint `step` whole or not at all; `extra`, a directory of more state (DeepSpeed's optimizer
    shards), is moved into it as `zero/` and covered by its manifest like every other file."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    with atomic_dir(final, kind=KIND) as tmp:
        try:
            _write_checkpoint(tmp, step, model, tokenizer, trainer_state, manifest, extra)
        except Exception as e:  # the writers' own errors name a temporary file, or none (safetensors)
            raise CheckpointWriteError(final, e) from e
    _point_latest(output_dir, final.name)
    _prune(output_dir, keep, final)
    return final


def _errno_of(error: BaseException) -> int | None:
    """The errno of the OSError behind `error`; a Rust writer's (safetensors) is only in its text."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        if e is not None and (told := _RUST_OS_ERROR.search(str(e))):
            return int(told.group(1))
    return None


def _write_checkpoint(
    tmp: Path, step: int, model, tokenizer, trainer_state: dict, manifest: dict, extra: Path | None
) -> None:
    quiet_transformers_progress()
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)  # with a vision model's image processor
    if extra is not None:
        os.replace(extra, tmp / ZERO_DIR)
    with open(tmp / TRAINER_STATE, "wb") as f:  # through Python, so that a failed write keeps its errno
        torch.save({**trainer_state, "rng": rng_state()}, f)
    files = file_hashes(tmp)
    write_json_atomic(
        tmp / MANIFEST,
        {
            **manifest,
            "kind": KIND,
            "step": step,
            "code_version": code_version(),
            "sha256": combined_sha256(files),
            "files": files,
        },
    )


def resume_checkpoint(output_dir: Path, repair: bool = True) -> Path | None:
    """The newest intact checkpoint in `output_dir` (None: start fresh); see the module docstring.

    With `repair` (one process per run: trainer rank 0), corrupt checkpoints are set aside and `latest` is
    pointed at the one returned; other ranks only read.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    pointer = output_dir / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    found = _checkpoints(output_dir)
    if named is not None and named not in {p.name for _, p in found}:
        log.warning(
            "%s names %s, which is missing; looking for the newest intact checkpoint instead",
            pointer,
            output_dir / named,
        )
    bad = []
    for _, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            if repair and named != path.name:
                _point_latest(output_dir, path.name)
            return path
        bad.append(path)
        if repair:
            log.warning(
                "checkpoint %s is corrupt and will not be trained on (%s); moved to %s",
                path,
                problem,
                _set_aside(path).name,
            )
    if (bad or named is not None) and repair:
        pointer.unlink(missing_ok=True)
        log.warning("no intact checkpoint left in %s: starting fresh from the base model", output_dir)
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from (a file missing or differing from its manifest), or None."""
    try:
        verify_output(path, KIND)
    except (IntegrityError, FileNotFoundError) as e:
        return str(e)
    if not (path / TRAINER_STATE).is_file():
        return f"{path / TRAINER_STATE} is missing"
    return None


def config_changes(saved: dict, current: dict) -> list[str]:
    """`key: old -> new` for each training setting that differs and may not change on resume.

    A setting the checkpoint does not record, set now to its default, is no change: the checkpoint was made
    by a grpoflow before the setting existed, which behaved as its default does.
    """
    flat_saved, flat_now = (
        _flatten(_json(saved), TRAINING_SECTIONS),
        _flatten(_json(current), TRAINING_SECTIONS),
    )
    defaults = _flatten(_json(Recipe().to_dict()), TRAINING_SECTIONS)
    for key, value in defaults.items():
        if key not in flat_saved and flat_now.get(key, _UNSET) == value:
            flat_saved[key] = value
    allowed = set(RESUMABLE_CHANGES)
    if flat_now.get("train.lr_scheduler_type") != "constant":
        allowed.discard("train.max_steps")  # a decaying schedule is defined by max_steps

    def show(flat: dict, key: str) -> str:
        return repr(flat[key]) if key in flat else "(unset)"

    return [
        f"{key}: {show(flat_saved, key)} -> {show(flat_now, key)}"
        for key in sorted(set(flat_saved) | set(flat_now))
        if key not in allowed and flat_saved.get(key, _UNSET) != flat_now.get(key, _UNSET)
    ]


def check_resumable(checkpoint: Path, recipe: Recipe, data_dir: Path, data_sha256: str | None) -> None:
    """Refuse (ConfigError) a checkpoint made with another training configuration or other data."""
    manifest = read_manifest(checkpoint)
    where = f"train.output_dir {Path(recipe.train.output_dir).resolve()} holds {checkpoint.name}"
    saved = manifest.get("recipe")
    changes = config_changes(saved, recipe.to_dict()) if isinstance(saved, dict) else []
    if changes:
        raise ConfigError(
            f"{where}, trained with a different configuration: {'; '.join(changes)}. Resuming "
            "would half-apply it: use a new train.output_dir, or the recipe it was trained with "
            f"(only {', '.join(sorted(RESUMABLE_CHANGES))} may change on resume)"
        )
    recorded = manifest.get("data_sha256")
    if recorded and recorded != data_sha256:
        raise ConfigError(
            f"{where}, trained on other data: {data_dir / 'manifest.json'} has sha256 "
            f"{data_sha256}, the checkpoint recorded {recorded}. Use a new train.output_dir, "
            "or restore the data it was trained on"
        )
    if manifest.get("step", 0) > recipe.train.max_steps:
        raise ConfigError(
            f"{where}, past train.max_steps={recipe.train.max_steps}; use train.max_steps >= "
            f"{manifest['step']} or a new train.output_dir"
        )


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(Path(checkpoint) / TRAINER_STATE, weights_only=False)


def _json(obj):
    return json.loads(json.dumps(obj, default=str))


def _flatten(tree: dict, sections: tuple[str, ...]) -> dict:
    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for section in sections:
        if section in tree:
            walk(section, tree[section])
    return out


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)))


def _point_latest(output_dir: Path, name: str) -> None:
    tmp_latest = output_dir / f".{LATEST}.tmp-{os.getpid()}"
    tmp_latest.write_text(name + "\n")
    os.replace(tmp_latest, output_dir / LATEST)


def _set_aside(path: Path) -> Path:
    aside, n = path.with_name(path.name + ".corrupt"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt{n}")
    os.replace(path, aside)
    return aside


def _prune(output_dir: Path, keep: int, newest: Path) -> None:
    steps = _checkpoints(output_dir)
    for _, path in steps[:-keep] if keep > 0 else []:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)


def serving_copy(checkpoint: str | os.PathLike, dest: str | os.PathLike) -> dict:
    """Write into `dest` (a new directory) the files of `checkpoint` (or of a base model) that serving needs:
    weights, config, tokenizer, chat template, generation config; hard links where the filesystem allows, so
    nothing is copied. The training state (`TRAINING_STATE`) is left out. Its manifest is the checkpoint's,
    with `files` and `sha256` over what `dest` holds (so `verify_output` checks it), and `checkpoint_sha256`
    (the whole checkpoint's, its identity in the registry) and `left_out` added. Returns that manifest.

    A LoRA run's checkpoint (an adapter) is served as the merged model (`_merged_serving_copy`).

    Raises IntegrityError naming the file when the checkpoint no longer matches its own manifest."""
    checkpoint, dest = Path(checkpoint), Path(dest)
    manifest = verify_output(checkpoint)
    if is_adapter_dir(checkpoint):
        return _merged_serving_copy(checkpoint, dest, manifest)
    kept = {name: sha for name, sha in manifest["files"].items() if name.split("/")[0] not in TRAINING_STATE}
    dest.mkdir(parents=True)
    for name in kept:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(checkpoint / name, target)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(checkpoint / name, target)
    return _write_served_manifest(dest, manifest, kept)


def _merged_serving_copy(checkpoint: Path, dest: Path, manifest: dict) -> dict:
    """`serving_copy` of an adapter checkpoint: the base model with the adapter merged in, in the base's own
    dtype, and the tokenizer, as a plain HF model folder (what serves, registers and evaluates without PEFT
    or the base model's files). Its manifest is the checkpoint's with `files` over `dest`, `merged_lora`
    true and the adapter's files among `left_out`."""
    from trainer.model_loading import load_model
    from trainer.recipe import ModelConfig

    model, tokenizer = load_model(str(checkpoint), ModelConfig(dtype="auto"), verify=False)
    quiet_transformers_progress()
    dest.mkdir(parents=True)
    model.save_pretrained(dest)
    save_tokenizer(tokenizer, dest)
    return _write_served_manifest(dest, manifest, file_hashes(dest), merged_lora=True)


def _write_served_manifest(dest: Path, manifest: dict, files: dict, **extra) -> dict:
    """A serving copy's manifest (the checkpoint's `manifest` with `files` and `sha256` over what `dest`
    holds, `checkpoint_sha256`, `left_out`, and `extra`), written into `dest` and returned."""
    served = {
        **manifest,
        "files": files,
        "sha256": combined_sha256(files),
        "checkpoint_sha256": manifest["sha256"],
        **extra,
        "left_out": sorted(set(manifest["files"]) - set(files)),
    }
    write_json_atomic(dest / MANIFEST, served)
    return served


@contextlib.contextmanager
def plain_model_dir(path: str | os.PathLike, scratch: str | os.PathLike | None = None) -> Iterator[Path]:
    """A directory any engine loads as a plain model (vLLM, EvalScope's transformers): `path` itself, or for
    a LoRA run's checkpoint its merged `serving_copy` in a temporary directory under `scratch` (the system's
    when None), removed when the block ends."""
    path = Path(path)
    if not is_adapter_dir(path):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix=".merged-", dir=scratch))
    try:
        serving_copy(path, tmp / path.name)
        yield tmp / path.name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
