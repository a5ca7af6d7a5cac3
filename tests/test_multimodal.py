"""Images in GRPO, end to end on a real tiny Qwen2-VL-architecture model (trainer.tiny_vl, made here in a
second): image rows validated at preparation, the manifest hashing image bytes, prompts with expanded image
placeholders, the engine's and the trainer's log-probs of a vision batch against a plain full forward, the
counting reward, and a short vision training run."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, loopback_http
from data.errors import DataError
from data.prepare import load_prepared, prepare
from data.shapes import QUESTION, draw_counting_image, write_counting_source
from trainer.logprobs import completion_logps
from trainer.model_loading import load_model
from trainer.prompts import encode_prompts
from trainer.recipe import ModelConfig, load_recipe
from trainer.rewards import counting_reward
from trainer.rollout.base import SamplingParams
from trainer.rollout.batch import RolloutBatch
from trainer.rollout.hf_engine import HFEngine
from trainer.typed_config import ConfigError
from trainer.vision import vision_of

VISION = ModelConfig(dtype="float32", modality="vision")


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    from trainer.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("tiny-vl") / "model", seed=0)


@pytest.fixture(scope="module")
def counting_data(tmp_path_factory) -> Path:
    src = write_counting_source(tmp_path_factory.mktemp("clevr-src"), 24, seed=0)
    out = tmp_path_factory.mktemp("clevr") / "prepared"
    prepare("counting", str(src), out, heldout=4, system_prompt="brief")
    return out


def png(path: Path, count: int, size: int = 56) -> Path:
    import random

    draw_counting_image(count, random.Random(count), size).save(path, format="PNG")
    return path


# ---- data --------------------------------------------------------------------------------------------------


def test_image_rows_fail_with_file_line_and_path_or_are_dropped_and_recorded(tmp_path):
    png(tmp_path / "ok.png", 2)
    (tmp_path / "broken.png").write_text("not an image")
    good = {"image": "ok.png", "problem": QUESTION, "solution": "<answer> 2 </answer>"}
    bad = {
        "missing": {"image": "gone.png", "solution": "<answer> 1 </answer>"},
        "unreadable": {"image": "broken.png", "solution": "<answer> 1 </answer>"},
        "count": {"image": "ok.png", "problem": "Count them.", "count": "three"},
    }
    expected = {
        "missing": f"field 'image': expected an existing image file; not found: {tmp_path / 'gone.png'}",
        "unreadable": f"field 'image': expected a readable image; {tmp_path / 'broken.png'}: cannot identify "
        "image file",
        "count": 'field \'count\': expected a non-negative integer count (3, "3" or "<answer> 3 </answer>"), '
        "got 'three'",
    }
    for case, row in bad.items():
        src = tmp_path / f"{case}.jsonl"
        src.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError) as error:
            prepare("counting", str(src), tmp_path / "out")
        assert str(error.value).startswith(f"{src}:2: {expected[case]}"), str(error.value)
        assert not (tmp_path / "out").exists()  # nothing half-written

    src = tmp_path / "all.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [good, *bad.values()]) + "\n")
    result = prepare("counting", str(src), tmp_path / "out", heldout=0, skip_invalid=True)
    assert result["rows"] == {"train": 1, "heldout": 0}
    assert result["dropped"] == {"image not found": 1, "unreadable image": 1, "invalid field 'count'": 1}
    examples = json.loads((tmp_path / "out" / "manifest.json").read_text())["dropped_examples"]
    assert [e["where"] for e in examples] == [f"{src}:2", f"{src}:3", f"{src}:4"]
    assert str(tmp_path / "broken.png") in examples[1]["detail"]


def test_images_as_lists_urls_bytes_and_base64_are_kept_and_hashed_by_their_bytes(tmp_path):
    a, b = png(tmp_path / "a.png", 1), png(tmp_path / "b.png", 3)
    b64 = base64.b64encode(b.read_bytes()).decode()

    class Images(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = a.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with loopback_http(Images) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
        src = tmp_path / "rows.jsonl"
        src.write_text(
            "\n".join(
                json.dumps(r)
                for r in [
                    {"images": ["a.png", f"file://{b}"], "count": 4},
                    {"image": url, "count": 1},
                    {"image": b64, "count": 3, "problem": "How many?"},
                    {"image": f"data:image/png;base64,{b64}", "count": 3, "problem": "How many now?"},
                ]
            )
            + "\n"
        )
        prepare("counting", str(src), tmp_path / "out", heldout=0)
        rows = load_prepared(tmp_path / "out")
        assert rows[0]["images"] == [str(a.resolve()), str(b.resolve())]
        assert rows[1]["images"] == [url]
        assert rows[2]["images"] == [f"data:image;base64,{b64}"]
        assert rows[3]["images"] == [f"data:image/png;base64,{b64}"]
        first = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert first["images"]["files"] == 5  # a, b, the URL, two embedded copies
        # the same paths, other pixels: the data's sha256 (what lineage records) changes
        png(a, 5)
        prepare("counting", str(src), tmp_path / "out", heldout=0)
    second = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert second["files"] == first["files"]  # the rows (paths) are byte for byte the same...
    assert second["images"]["sha256"] != first["images"]["sha256"]
    assert second["sha256"] != first["sha256"]  # ...but the data is not


def test_parquet_image_feature_bytes_are_embedded(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = png(tmp_path / "c.png", 4).read_bytes()
    pq.write_table(
        pa.table({"image": [{"bytes": data, "path": None}], "problem": [QUESTION], "solution": ["4"]}),
        tmp_path / "train.parquet",
    )
    prepare("counting", str(tmp_path / "train.parquet"), tmp_path / "out", heldout=0)
    [row] = load_prepared(tmp_path / "out")
    assert row["answer"] == "4" and base64.b64decode(row["images"][0].split(",", 1)[1]) == data


# ---- prompts, engine and trainer forward -------------------------------------------------------------------


def test_image_placeholders_expand_to_the_patches_over_merge_squared(tmp_path):
    from trainer.tiny_vl import build_tiny_vl

    model, tok = load_model(str(build_tiny_vl(tmp_path / "merge2", merge=2)), VISION)  # Qwen's own 2x2 merge
    small, large = png(tmp_path / "s.png", 2, 56), png(tmp_path / "l.png", 2, 112)
    rows = [
        {"id": "r0", "prompt": [{"role": "user", "content": "How many?"}], "images": [str(small)]},
        {
            "id": "r1",
            "prompt": [{"role": "user", "content": "How many?"}],
            "images": [str(small), str(large)],
        },
    ]
    one, two = encode_prompts(tok, rows)
    pad = model.config.image_token_id
    # 56x56 at patch 14: a 4x4 grid of patches, merged 2x2 -> 4 tokens; 112x112: 8x8 -> 16
    assert one.vision.image_grid_thw.tolist() == [[1, 4, 4]] and one.count(pad) == 4
    assert two.vision.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 8]] and two.count(pad) == 20
    assert tuple(one.vision.pixel_values.shape) == (16, 3 * 2 * 14 * 14)
    text = tok.decode(one)
    assert text.startswith(
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>How many?"
    )
    with pytest.raises(
        ValueError,
        match=r"row 'r1': its prompt is \d+ tokens with its images, over "
        r"train.max_prompt_length 20",
    ):
        encode_prompts(tok, rows, max_prompt_length=20)


def test_rows_with_media_a_model_cannot_take_are_refused_naming_the_row(tiny_base, tiny_vl, tmp_path):
    _, text_tok = load_model(tiny_base["path"])
    row = {
        "id": "clevr-7",
        "prompt": [{"role": "user", "content": "How many?"}],
        "images": [str(png(tmp_path / "x.png", 1))],
    }
    with pytest.raises(
        ValueError,
        match=r"row 'clevr-7': it has images, but the model was loaded without an image "
        r"processor: set model.modality: vision",
    ):
        encode_prompts(text_tok, [row])
    # a video column passes prep (the schema keeps it for models whose processor takes videos)...
    src = tmp_path / "clips.jsonl"
    src.write_text(
        json.dumps({"image": str(png(tmp_path / "y.png", 2)), "count": 2, "videos": ["clip.mp4"]}) + "\n"
    )
    prepare("counting", str(src), tmp_path / "out", heldout=0)
    [prepared] = load_prepared(tmp_path / "out")
    assert prepared["videos"] == ["clip.mp4"]
    # ...and this trainer, which gives models images only, refuses the row by name
    _, tok = load_model(str(tiny_vl), VISION)
    with pytest.raises(
        ValueError,
        match=r"row 'counting-00000': it has videos, which this trainer cannot give a "
        r"model yet \(images only\)",
    ):
        encode_prompts(tok, [prepared])


def plain_logps(model, prompt, completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """One unpadded sequence through the model the way its own processor's output would go (positions computed
    by the model itself): the reference the batched paths must equal."""
    ids = torch.tensor([list(prompt) + completion])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=prompt.vision.pixel_values,
            image_grid_thw=prompt.vision.image_grid_thw,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_a_vision_batchs_log_probs_equal_a_plain_full_forward(tiny_vl, tmp_path):
    model, tok = load_model(str(tiny_vl), VISION)
    model.eval()
    images = [png(tmp_path / "a.png", 1, 56), png(tmp_path / "b.png", 4, 112), png(tmp_path / "c.png", 6, 84)]
    rows = [
        {"id": f"r{i}", "prompt": [{"role": "user", "content": q}], "images": [str(p)]}
        for i, (p, q) in enumerate(
            zip(images, ["How many?", "Count the shapes, please.", "How many?"], strict=True)
        )
    ]
    prompts = encode_prompts(tok, rows)
    assert len({len(p) for p in prompts}) == 3  # three prompt lengths: the batch is padded
    groups = HFEngine(model, tok).generate(prompts, 3, SamplingParams(max_tokens=10, temperature=1.0, seed=6))
    completions = [c for g in groups for c in g]
    assert all(c.token_ids for c in completions)
    # the untrained model samples the image placeholder now and then (3 seeds of 0-11 have one in their 90
    # tokens): such a completion is padded in the trainer's forward and left out of the loss, while the
    # reference forward below takes the tokens as they are, so this seed's completions have none
    image_token = vision_of(prompts[0]).image_token_id
    assert not any(image_token in c.token_ids for c in completions)
    batch = RolloutBatch(
        [p for p, g in zip(prompts, groups, strict=True) for _ in g],
        completions,
        torch.zeros(len(completions)),
        torch.ones(len(completions)),
    )
    mb = batch.micro_batch(torch.arange(len(batch)), tok.pad_token_id)
    assert mb.vision is not None and mb.vision.image_grid_thw.shape[0] == len(completions)
    with torch.no_grad():
        shared, _ = completion_logps(
            model, mb, 1.0, share_prompts=True
        )  # vision falls back to the full forward
        full, _ = completion_logps(model, mb, 1.0)
    assert torch.equal(shared, full)
    for row, (prompt, completion) in enumerate(zip(batch.prompt_ids, completions, strict=True)):
        n = len(completion.token_ids)
        reference = plain_logps(model, prompt, completion.token_ids)
        assert torch.allclose(full[row, :n], reference, atol=1e-5), row  # the trainer's batched forward
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-5), (
            row
        )  # the engine's decode
    # the image matters: the same tokens with another image of the same size give other log-probs
    other = encode_prompts(tok, [{**rows[0], "images": [str(png(tmp_path / "d.png", 5, 56))]}])[0]
    assert list(other) == list(prompts[0])
    assert not torch.allclose(
        plain_logps(model, other, completions[0].token_ids),
        plain_logps(model, prompts[0], completions[0].token_ids),
    )


def test_the_counting_reward_on_hand_written_completions():
    completions = [
        "<think> two circles and a square </think><answer> 3 </answer>",
        "<think> I see 3 </think><answer>three</answer>",
        "<answer> 03 </answer>",
        "3",  # no answer block, no \\boxed{}: nothing to grade
        "<answer> 2 </answer> <answer> 4 </answer>",  # the last answer counts
        "<answer> 3.0 </answer>",
    ]
    assert counting_reward([None] * 6, completions, ["3", "3", "3", "3", "4", "3"]) == [
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        1.0,
    ]
    assert counting_reward([None], ["<answer> 3 </answer>"], [""]) == [
        None
    ]  # a missing gold is the row's fault


# ---- training ----------------------------------------------------------------------------------------------


def vision_recipe(tmp_path: Path, model: Path, data: Path, *overrides: str):
    return load_recipe(
        REPO_ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"model.name_or_path={model}",
            "model.modality=vision",
            "data.task=counting",
            f"data.out={data}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.prompts_per_step=2",
            "train.num_generations=4",
            "train.micro_batch_size=4",
            "train.max_prompt_length=128",
            "train.max_completion_length=12",
            "train.eval_heldout=4",
            "train.save_steps=2",
            "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
            "rewards=[{name: counting}, {name: format, weight: 0.2}]",
            *overrides,
        ],
    )


def test_a_short_vision_training_run_changes_the_weights_and_keeps_the_ratio_exactly_one_on_the_first_pass(
    tiny_vl, counting_data, tmp_path, loss_ratios
):
    from safetensors.torch import load_file

    from trainer.grpo import GRPOTrainer

    # the untrained model never answers, so counting and format are 0 for every sample and every advantage 0:
    # a reward that differs between samples (their distinct characters) gives the update something to follow
    plugin = tmp_path / "variety.py"
    plugin.write_text(
        "def variety(prompts, completions, **kw):\n    return [len(set(c)) / 10 for c in completions]\n"
    )
    recipe = vision_recipe(
        tmp_path,
        tiny_vl,
        counting_data,
        "train.max_steps=2",
        "train.num_iterations=2",
        "train.learning_rate=1e-3",
        f"rewards=[{{name: counting}}, {{name: format, weight: 0.2}}, {{name: '{plugin}:variety'}}]",
    )
    trainer = GRPOTrainer(recipe, str(tiny_vl), counting_data, progress=False)
    trainer.setup()
    batch, _ = trainer.rollout_source().next(0)
    assert all(p.vision is not None for p in batch.prompt_ids)
    mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        before, _ = completion_logps(trainer.model, mb, recipe.train.temperature)
    mask = mb.completion_mask > 0
    assert torch.allclose(before[mask], mb.behaviour_logps[mask], atol=1e-4)  # engine and trainer agree

    # setup again from scratch: two steps, two passes each, held-out before and after
    result = trainer.train()
    assert result.steps == 2 and result.heldout_before is not None and result.heldout_after is not None
    # the ratios the trainer's loss saw (2 steps x 2 passes x 2 micro-batches of 4): exactly 1 on each first
    # pass, moved on the second
    assert [first for first, _ in loss_ratios] == [True, True, False, False] * 2
    for first, ratio in loss_ratios:
        assert torch.equal(ratio, torch.ones_like(ratio)) == first, (first, (ratio - 1).abs().max())
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("rewards/counting/mean" in r and "rewards/format/mean" in r for r in rows)
    checkpoint = Path(result.checkpoint)
    assert (checkpoint / "preprocessor_config.json").is_file()  # the checkpoint loads as a vision model again
    base, trained = load_file(tiny_vl / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    moved = [n for n in base if not torch.equal(base[n], trained[n])]
    assert any(
        n.startswith("visual.") for n in moved
    )  # gradients reached the vision tower (saved as transformers
    assert any(
        n.startswith("model.layers.") for n in moved
    )  # writes Qwen2-VL checkpoints: visual.*, model.*)
    assert rows[0]["reward_std"] > 0
    reloaded, tok = load_model(str(checkpoint), VISION)
    assert tok.vision is not None and type(reloaded).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.parametrize(
    "override", ["rollout.engine=vllm", "rollout.engine=lmdeploy", "train.deepspeed=zero2"]
)
def test_vision_recipes_on_paths_images_do_not_reach_yet_are_refused_before_any_work(
    tiny_vl, counting_data, tmp_path, override
):
    from trainer.grpo import check_supported

    with pytest.raises(
        ConfigError,
        match="model.modality: vision trains with rollout.engine: transformers and without DeepSpeed",
    ):
        check_supported(vision_recipe(tmp_path, tiny_vl, counting_data, override))


def test_asynchronous_rollout_workers_generate_from_the_images_and_the_trainer_scores_their_log_probs(
    tiny_vl, counting_data, tmp_path
):
    """A rollout worker process (spawned, its own copy of the model) gets the pickled prompts with their
    pixels: its log-probs equal the trainer's forward of the same tokens and images."""
    from trainer.grpo import GRPOTrainer

    recipe = vision_recipe(
        tmp_path, tiny_vl, counting_data, "train.max_steps=2", "rollout.async=true", "train.eval_heldout=0"
    )
    trainer = GRPOTrainer(recipe, str(tiny_vl), counting_data, progress=False)
    trainer.setup()
    with trainer.rollout_source() as source:
        source.start(0)
        batch, _ = source.next(0)
    assert batch.policy_version == 0 and all(p.vision is not None for p in batch.prompt_ids)
    mb = batch.micro_batch(torch.arange(len(batch)), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        ours, _ = completion_logps(trainer.model, mb, recipe.train.temperature)
    mask = mb.completion_mask > 0
    assert torch.allclose(ours[mask], mb.behaviour_logps[mask], atol=1e-4)


def test_the_real_recipe_loads_and_builds_its_processor_path_with_the_tiny_model(tiny_vl, tmp_path):
    recipe = load_recipe(REPO_ROOT / "configs" / "qwen2.5-vl-3b-clevr-counting.yaml", [])
    assert (recipe.model.modality, recipe.train.learning_rate, recipe.train.max_completion_length) == (
        "vision",
        1e-6,
        1024,
    )
    assert [r.name for r in recipe.rewards] == ["counting", "format"]
    assert (recipe.rollout.train_devices, recipe.rollout.rollout_devices) == ([0, 1, 2, 3, 4, 5], [6, 7])
    model, tok = load_model(
        str(tiny_vl), recipe.model
    )  # the recipe's model settings, the tiny model's weights
    assert (
        model.dtype == torch.bfloat16
        and type(tok.vision.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    )


def test_a_completion_that_samples_an_image_placeholder_is_left_out_of_the_loss_and_the_forward_still_runs(
    tiny_vl, tmp_path
):
    from trainer.rollout.base import Completion

    model, tok = load_model(str(tiny_vl), VISION)
    [prompt] = encode_prompts(
        tok,
        [
            {
                "id": "r",
                "prompt": [{"role": "user", "content": "How many?"}],
                "images": [str(png(tmp_path / "a.png", 3))],
            }
        ],
    )
    pad, word = model.config.image_token_id, tok.convert_tokens_to_ids("<answer>")
    completions = [
        Completion([word, pad, word], [-1.0, -2.0, -3.0], "length"),
        Completion([word, word], [-1.0, -1.0], "length"),
    ]
    batch = RolloutBatch([prompt, prompt], completions, torch.tensor([1.0, -1.0]), torch.ones(2))
    mb = batch.micro_batch(torch.arange(2), tok.pad_token_id)
    assert mb.completion_mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert mb.completion_ids[0].tolist() == [
        word,
        tok.pad_token_id,
        word,
    ]  # no image placeholder without an image
    with torch.no_grad():
        logps, _ = completion_logps(
            model, mb, 1.0
        )  # one image per prompt, as many placeholders as its patches
    assert torch.allclose(logps[1, :2], plain_logps(model, prompt, [word, word]), atol=1e-5)


# ---- the pipeline ------------------------------------------------------------------------------------------


def test_grpoflow_run_on_the_vision_demo_registers_a_loadable_model_with_the_image_hash_in_its_lineage(
    tmp_path, monkeypatch
):
    """`grpoflow run --config configs/tiny-vl-counting-cpu.yaml` as a user runs it (a subprocess, its own
    state, a few steps): prep, the counting bootstrap, training, registration, the held-out evaluation."""
    import os
    import subprocess
    import sys

    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            str(REPO_ROOT / "configs" / "tiny-vl-counting-cpu.yaml"),
            "--state-dir",
            str(tmp_path / "state"),
            "--json",
            f"bootstrap.out={tmp_path / 'base'}",
            f"data.out={tmp_path / 'data'}",
            "data.synthetic_rows=400",
            f"train.output_dir={tmp_path / 'runs'}",
            "train.max_steps=3",
            "train.save_steps=3",
            "train.eval_heldout=16",
            "train.prompts_per_step=4",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(
        proc.stdout
    )  # --json: stdout is the JSON object alone (DeepSpeed's warning went to stderr)
    assert (
        summary["scores"] == {"heldout_accuracy": summary["heldout_accuracy_after"]} and summary["steps"] == 3
    )
    base = json.loads((tmp_path / "base" / "manifest.json").read_text())
    assert 0.3 <= base["heldout_accuracy"] <= 0.6  # the recipe's warm-up band

    uri = f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    [version] = client.search_model_versions("name='grpoflow-tiny-vl-counting'")
    data = json.loads((tmp_path / "data" / "manifest.json").read_text())
    # every image (embedded in the rows; a drawn twin of another is dropped as a duplicate prompt), hashed by
    # its bytes
    assert data["images"]["files"] == data["rows"]["train"] + data["rows"]["heldout"] >= 390
    assert version.tags["dataset_sha256"] == data["sha256"]
    train_run = next(
        r
        for r in client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
        if r.info.run_name == "train"
    )
    assert "plots/heldout_answers.png" in {
        a.path for a in client.list_artifacts(train_run.info.run_id, "plots")
    }

    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", uri
    )  # for this test only (mlflow.set_tracking_uri would outlive it)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    model = mlflow.pyfunc.load_model(f"models:/grpoflow-tiny-vl-counting/{version.version}")
    heldout = load_prepared(tmp_path / "data", "heldout")[:2]
    answers = model.predict(
        pd.DataFrame({"prompt": [QUESTION] * 2, "image": [r["images"][0] for r in heldout]}),
        params={"max_new_tokens": 20},
    )
    # the registered model answers as the checkpoint does (greedy, the same encoding)
    checkpoint, tok = load_model(summary["checkpoint"], VISION)
    rows = [{**r, "prompt": [{"role": "user", "content": QUESTION}]} for r in heldout]
    direct = HFEngine(checkpoint.eval(), tok).generate(
        encode_prompts(tok, rows), 1, SamplingParams(max_tokens=20, temperature=0.0)
    )
    assert answers == [g[0].text for g in direct]


def test_two_gloo_ranks_update_a_vision_model_as_one_rank_does(tiny_vl, counting_data, tmp_path):
    """DDP: each rank forwards its share of the rows with their own images; the averaged gradient, vision
    tower included, equals one rank's on the whole batch."""
    import os
    import subprocess
    import sys

    from test_async import DDP_SCRIPT  # one update's gradient, as the text DDP test takes it

    script = tmp_path / "update.py"
    script.write_text(DDP_SCRIPT)
    grads = {}
    for ranks in (1, 2):
        recipe_args = [
            f"model.name_or_path={tiny_vl}",
            "model.modality=vision",
            "data.task=counting",
            f"data.out={counting_data}",
            f"train.output_dir={tmp_path / f'run{ranks}'}",
            "train.prompts_per_step=2",
            "train.num_generations=4",
            "train.micro_batch_size=2",
            "train.max_prompt_length=128",
            "train.max_completion_length=12",
            "train.eval_heldout=0",
            "train.learning_rate=1e-3",
            "rollout.async=false",  # sampled between updates (the shipped recipe: meanwhile)
            "rewards=[{name: counting}]",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                str(script),
                str(REPO_ROOT / "configs" / "tiny-cpu.yaml"),
                str(tiny_vl),
                str(tmp_path / f"grads{ranks}.pt"),
                *recipe_args,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        grads[ranks] = torch.load(tmp_path / f"grads{ranks}.pt")["grads"]
    assert grads[1].keys() == grads[2].keys()
    assert any(n.startswith("model.visual.") and g.abs().sum() > 0 for n, g in grads[1].items())
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[2][name], g, rtol=1e-4, atol=1e-6)
