"""Dataset preparation on the real reference data in ../shared/data and on small files written here.

Expected answers were read off the source files by hand (e.g. gsm8k/train.jsonl line 1 ends in `#### 72`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler
from itertools import permutations
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import grpoflow_run, last_json, loopback_http, one_line_error
from data import images
from data.adapters import COUNTDOWN_PROMPT, numina
from data.prepare import DataError, load_prepared, prepare
from data.schema import SYSTEM_PROMPT, user_text
from data.synthetic import in_eval_pool
from trainer.rewards.countdown import countdown_reward

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
GSM8K = SHARED / "gsm8k" / "train.jsonl"
MATH500 = SHARED / "math_500" / "test.jsonl"
COUNTDOWN = SHARED / "countdown" / "test.jsonl"

needs_shared = pytest.mark.usefixtures(
    "shared_data"
)  # fails, naming the path, when ../shared/data is missing


def all_rows(out: Path) -> dict[str, dict]:
    rows = load_prepared(out, "train") + load_prepared(out, "heldout")
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "ids must be unique"
    return by_id


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def copy_lines(src: Path, dst: Path, n: int, edit: dict[int, str] | None = None) -> Path:
    """The first `n` lines of `src`, with 1-based line numbers in `edit` replaced."""
    lines = src.read_text(encoding="utf-8").splitlines()[:n]
    for lineno, text in (edit or {}).items():
        lines[lineno - 1] = text
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dst


# --- the real reference data ---


@needs_shared
def test_gsm8k_train_all_rows_with_final_answers(tmp_path):
    result = prepare("gsm8k", str(GSM8K), tmp_path / "out")
    assert result["rows"]["train"] + result["rows"]["heldout"] == 7473
    assert result["rows"]["heldout"] == round(7473 * 0.1)
    assert result["dropped"] == {}
    rows = all_rows(tmp_path / "out")
    first = rows["gsm8k-00000"]
    assert first["answer"] == "72"  # line 1: "... #### 72"
    assert first["task"] == "gsm8k"
    assert first["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert user_text(first).startswith("Natalia sold clips to 48 of her friends in April")
    assert rows["gsm8k-00001"]["answer"] == "10"
    assert rows["gsm8k-00345"]["answer"] == "1080"  # line 346: "#### 1,080"
    assert rows["gsm8k-00367"]["answer"] == "850000"  # line 368: "#### 850,000"


@needs_shared
def test_math500_answers_columns_and_own_ids(tmp_path):
    result = prepare("math", str(MATH500), tmp_path / "out", heldout=0)
    assert result["rows"] == {"train": 500, "heldout": 0}
    first = all_rows(tmp_path / "out")["math-test/precalculus/807.json"]
    assert first["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert (first["subject"], first["level"]) == ("Precalculus", 2)
    assert first["unique_id"] == "test/precalculus/807.json"


@needs_shared
def test_math500_boxed_answer_used_when_answer_field_is_missing(tmp_path):
    """Each MATH-500 `answer` is the last \\boxed{} of its solution: dropping the field changes nothing."""
    stripped = tmp_path / "no_answer.jsonl"
    with open(MATH500) as f, open(stripped, "w") as g:
        for line in f:
            row = json.loads(line)
            del row["answer"]
            g.write(json.dumps(row) + "\n")
    prepare("math", str(MATH500), tmp_path / "with", heldout=0)
    prepare("math", str(stripped), tmp_path / "without", heldout=0)
    assert load_prepared(tmp_path / "with") == load_prepared(tmp_path / "without")


@needs_shared
def test_countdown_input_output_format(tmp_path):
    result = prepare("countdown", str(COUNTDOWN), tmp_path / "out", heldout=0)
    assert result["rows"]["train"] == 256
    first = load_prepared(tmp_path / "out")[0]  # line 1: {"input": "30,100,93", "output": "23"}
    assert (first["nums"], first["target"], first["answer"]) == ([30, 100, 93], 23, "23")
    assert user_text(first) == (
        "Using the numbers [30, 100, 93], create an equation that equals 23. You can use basic arithmetic "
        "operations (+, -, *, /) and each number exactly once. Show your work in <think> </think> tags and "
        "return the final equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
    )


@needs_shared
def test_manifest_records_source_hash_and_settings(tmp_path):
    from data.manifest import sha256_dir, sha256_file

    result = prepare("countdown", str(COUNTDOWN), tmp_path / "out", seed=3, heldout=16)
    m = manifest(tmp_path / "out")
    assert m["kind"] == "prepared-dataset"
    assert m["sha256"] == result["sha256"] == sha256_dir(tmp_path / "out")
    assert m["rows"] == result["rows"] == {"train": 240, "heldout": 16}
    assert m["source"]["files"] == [{"path": str(COUNTDOWN.resolve()), "sha256": sha256_file(COUNTDOWN)}]
    assert (m["task"], m["seed"], m["heldout"], m["split"], m["split_by"]) == (
        "countdown",
        3,
        16,
        "train",
        "seeded shuffle",
    )
    assert m["dropped"] == {} and m["dropped_examples"] == []
    assert m["code_version"] and m["created_at"]
    assert result["manifest"] == str((tmp_path / "out" / "manifest.json").resolve())


# --- bad records ---

BROKEN = {
    "not JSON": ('{"question": "What is 1 + 1?", "answer": "#### 2"', "invalid JSON", "not valid JSON"),
    "missing field": ('{"question": "What is 1 + 1?"}', "missing field 'answer'", "field 'answer'"),
    "empty answer": (
        '{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### "}',
        "empty field 'answer'",
        "field 'answer': expected a worked solution ending in '#### <number>'",
    ),
}


@needs_shared
@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_line_fails_with_its_line_number_and_leaves_no_output(tmp_path, case):
    line, _, message = BROKEN[case]
    src = copy_lines(GSM8K, tmp_path / "gsm8k-copy.jsonl", 30, {17: line})
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        prepare("gsm8k", str(src), out)
    assert f"gsm8k-copy.jsonl:17: {message}" in str(err.value)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["gsm8k-copy.jsonl"]  # no temporary directory left either


@needs_shared
@pytest.mark.parametrize("case", list(BROKEN))
def test_skip_invalid_drops_the_line_and_counts_the_reason(tmp_path, case):
    line, reason, _ = BROKEN[case]
    src = copy_lines(GSM8K, tmp_path / "gsm8k-copy.jsonl", 30, {17: line})
    result = prepare("gsm8k", str(src), tmp_path / "out", skip_invalid=True)
    assert result["rows"]["train"] + result["rows"]["heldout"] == 29
    assert result["dropped"] == {reason: 1}
    m = manifest(tmp_path / "out")
    assert m["dropped"] == {reason: 1}
    assert [(e["where"], e["reason"]) for e in m["dropped_examples"]] == [(f"{src}:17", reason)]
    assert "gsm8k-00016" not in all_rows(tmp_path / "out")  # ids keep source positions: line 17 is index 16
    assert "gsm8k-00017" in all_rows(tmp_path / "out")


@needs_shared
def test_failed_run_leaves_an_existing_output_untouched(tmp_path):
    out = tmp_path / "out"
    good = prepare("gsm8k", str(copy_lines(GSM8K, tmp_path / "good.jsonl", 20)), out)
    bad = copy_lines(GSM8K, tmp_path / "bad.jsonl", 20, {5: "oops"})
    with pytest.raises(DataError, match="bad.jsonl:5"):
        prepare("gsm8k", str(bad), out)
    assert manifest(out)["sha256"] == good["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "out"]


@needs_shared
def test_duplicate_prompts_are_dropped_and_counted(tmp_path):
    lines = GSM8K.read_text().splitlines()[:10]
    src = copy_lines(GSM8K, tmp_path / "dup.jsonl", 11, {11: lines[2]})
    result = prepare("gsm8k", str(src), tmp_path / "out")
    assert result["rows"]["train"] + result["rows"]["heldout"] == 10
    assert result["dropped"] == {"duplicate prompt": 1}
    example = manifest(tmp_path / "out")["dropped_examples"][0]
    assert example["where"] == f"{src}:11" and example["detail"] == f"same prompt as {src}:3"


def test_gsm8k_answer_must_be_a_number(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "so\n#### twelve"}) + "\n")
    with pytest.raises(DataError, match=r"g.jsonl:1: field 'answer': expected .*got 'twelve'"):
        prepare("gsm8k", str(src), tmp_path / "out", heldout=0)


# --- split, seed, limit ---


@needs_shared
def test_same_seed_same_hash_other_seed_other_split(tmp_path):
    a = prepare("countdown", str(COUNTDOWN), tmp_path / "a", seed=7)
    b = prepare("countdown", str(COUNTDOWN), tmp_path / "b", seed=7)
    c = prepare("countdown", str(COUNTDOWN), tmp_path / "c", seed=8)
    assert a["sha256"] == b["sha256"] != c["sha256"]
    assert a["rows"] == c["rows"]
    held_a = {r["id"] for r in load_prepared(tmp_path / "a", "heldout")}
    held_c = {r["id"] for r in load_prepared(tmp_path / "c", "heldout")}
    assert held_a != held_c


@needs_shared
@pytest.mark.parametrize(("heldout", "expected"), [(0.25, 64), (10, 10), (0, 0), (1.0, 1), (0.001, 1)])
def test_heldout_as_fraction_or_count(tmp_path, heldout, expected):
    result = prepare("countdown", str(COUNTDOWN), tmp_path / "out", heldout=heldout)
    assert result["rows"] == {"train": 256 - expected, "heldout": expected}
    assert (tmp_path / "out" / "heldout.jsonl").read_text().count("\n") == expected


@needs_shared
@pytest.mark.parametrize("heldout", [1.5, -0.1, True, 256, "0.1"])
def test_bad_heldout_is_refused(tmp_path, heldout):
    with pytest.raises(DataError, match="heldout"):
        prepare("countdown", str(COUNTDOWN), tmp_path / "out", heldout=heldout)
    assert not (tmp_path / "out").exists()


@needs_shared
def test_limit_keeps_the_first_usable_rows(tmp_path):
    src = copy_lines(GSM8K, tmp_path / "g.jsonl", 10, {2: "not json"})
    result = prepare("gsm8k", str(src), tmp_path / "out", limit=5, heldout=0, skip_invalid=True)
    assert [r["id"] for r in load_prepared(tmp_path / "out")] == [f"gsm8k-{i:05d}" for i in (0, 2, 3, 4, 5)]
    assert result["dropped"] == {"invalid JSON": 1}


# --- source kinds ---

COUNTDOWN_ROWS = [
    {"nums": [30, 100, 93], "target": 23},
    {"nums": [83, 18, 75], "target": 10},
    {"nums": [76, 41, 59], "target": 24},
]


def test_parquet_source(tmp_path):
    import pandas as pd

    src = tmp_path / "cd.parquet"
    pd.DataFrame(COUNTDOWN_ROWS).to_parquet(src)
    prepare("countdown", str(src), tmp_path / "out", heldout=0)
    rows = load_prepared(tmp_path / "out")
    assert [(r["nums"], r["target"], r["answer"]) for r in rows] == [
        ([30, 100, 93], 23, "23"),
        ([83, 18, 75], 10, "10"),
        ([76, 41, 59], 24, "24"),
    ]
    assert user_text(rows[0]) == COUNTDOWN_PROMPT.format(nums=[30, 100, 93], target=23)


def test_parquet_written_by_datasets(tmp_path):
    import datasets

    src = tmp_path / "math.parquet"
    datasets.Dataset.from_list(
        [
            {
                "problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?",
                "solution": "It is $\\boxed{1}$.",
                "answer": "",
            },
            {
                "problem": "Simplify $\\sqrt{4}$.",
                "solution": "So $\\boxed{\\sqrt{4}} = \\boxed{2}$.",
                "answer": "",
            },
        ]
    ).to_parquet(src)
    prepare("math", str(src), tmp_path / "out", heldout=0)
    assert [r["answer"] for r in load_prepared(tmp_path / "out")] == ["1", "2"]


def test_csv_source_and_its_row_numbers(tmp_path):
    src = tmp_path / "cd.csv"
    src.write_text('input,output\n"30,100,93",23\n"83,18,75",ten\n')
    with pytest.raises(
        DataError, match=r"cd.csv row 2: field 'output': expected an integer target, got 'ten'"
    ):
        prepare("countdown", str(src), tmp_path / "out")
    result = prepare("countdown", str(src), tmp_path / "out", heldout=0, skip_invalid=True)
    assert result["dropped"] == {"invalid field 'output'": 1}
    assert load_prepared(tmp_path / "out")[0]["nums"] == [30, 100, 93]


@needs_shared
def test_directory_source_prefers_the_requested_split(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    copy_lines(GSM8K, src / "train.jsonl", 12)
    copy_lines(SHARED / "gsm8k" / "test.jsonl", src / "test.jsonl", 5)
    (src / "README.md").write_text("not data")
    assert prepare("gsm8k", str(src), tmp_path / "tr", heldout=0)["rows"]["train"] == 12
    assert prepare("gsm8k", str(src), tmp_path / "te", heldout=0, split="test")["rows"]["train"] == 5
    assert load_prepared(tmp_path / "te")[0]["answer"] == "18"  # test.jsonl line 1 ends in "#### 18"
    assert [Path(f["path"]).name for f in manifest(tmp_path / "te")["source"]["files"]] == ["test.jsonl"]
    with pytest.raises(DataError, match=r"no files for split 'validation' \(found splits: test, train\)"):
        prepare("gsm8k", str(src), tmp_path / "va", split="validation")


@needs_shared
def test_directory_without_split_names_reads_every_file_in_order(tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    copy_lines(GSM8K, src / "b.jsonl", 3)
    (src / "a.jsonl").write_text(GSM8K.read_text().splitlines()[5] + "\n")
    prepare("gsm8k", str(src), tmp_path / "out", heldout=0)
    # a.jsonl (line 6 of train.jsonl, "#### 35") comes first, then b.jsonl (lines 1-3)
    assert [r["answer"] for r in load_prepared(tmp_path / "out")] == ["35", "72", "10", "5"]


def test_directory_with_only_subdirectories_names_them(tmp_path):
    (tmp_path / "snap" / "main").mkdir(parents=True)
    (tmp_path / "snap" / "socratic").mkdir()
    with pytest.raises(DataError, match="subdirectories main, socratic"):
        prepare("gsm8k", str(tmp_path / "snap"), tmp_path / "out")


def test_output_may_not_replace_its_source(tmp_path):
    src = tmp_path / "d"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError, match="would replace the source"):
        prepare("gsm8k", str(src), src, heldout=0)
    assert (src / "train.jsonl").exists()


def test_counting_with_images_next_to_the_source(tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    for name, color in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (4, 4), color).save(tmp_path / "images" / name)
    src = tmp_path / "clevr.jsonl"
    src.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "image_path": "images/a.png",
                    "problem": "How many cubes are there?",
                    "solution": "<answer> 3 </answer>",
                },
                {"image": str(tmp_path / "images" / "b.png"), "count": 0},
                {"image": "images/missing.png", "count": 1},
            ]
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"clevr.jsonl:3: field 'image': expected an existing image file"):
        prepare("counting", str(src), tmp_path / "out")
    result = prepare("counting", str(src), tmp_path / "out", heldout=0, skip_invalid=True)
    assert result["dropped"] == {"image not found": 1}
    a, b = load_prepared(tmp_path / "out")
    assert (user_text(a), a["answer"], a["images"]) == (
        "How many cubes are there?",
        "3",
        [str((tmp_path / "images" / "a.png").resolve())],
    )
    assert (user_text(b), b["answer"]) == ("How many items are there in the image?", "0")
    assert manifest(tmp_path / "out")["images"]["files"] == 2


# --- images within limits ---


def small_png(path: Path) -> bytes:
    from PIL import Image

    Image.new("RGB", (4, 4), "red").save(path)
    return path.read_bytes()


def image_url_rows(tmp_path: Path, url: str) -> Path:
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"image": url, "count": 1}) + "\n")
    return src


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_an_image_url_has_one_deadline_for_the_whole_request(tmp_path, monkeypatch):
    """A server sending a valid PNG one byte every 0.25 s (about 20 s in all) answers every read long before a
    read timeout; the whole request still ends at its deadline (set to 1 s here), naming the URL and the
    limit."""
    body = small_png(tmp_path / "a.png")
    assert len(body) * 0.25 > 15

    class Drip(QuietHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)):
                try:
                    self.wfile.write(body[i : i + 1])
                except OSError:  # the client has gone
                    return
                time.sleep(0.25)

    monkeypatch.setattr(images, "URL_TIMEOUT_S", 1.0)
    with loopback_http(Drip) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/slow.png"
        started = time.monotonic()
        with pytest.raises(DataError) as e:
            prepare("counting", str(image_url_rows(tmp_path, url)), tmp_path / "out", heldout=0)
        took = time.monotonic() - started
    assert took < 10, f"the request ran {took:.1f} s past a 1 s deadline"
    assert (
        f"rows.jsonl:1: field 'image': expected an image within limits; {url}: no complete answer within 1 s"
        in str(e.value)
    )
    assert "data.images.URL_TIMEOUT_S" in str(e.value)
    assert not (tmp_path / "out").exists()
    with loopback_http(Drip) as server:  # skipped, the row is counted under its own reason
        url = f"http://127.0.0.1:{server.server_address[1]}/slow.png"
        with pytest.raises(DataError, match=r"no usable rows .*'image timed out': 1"):
            prepare("counting", str(image_url_rows(tmp_path, url)), tmp_path / "out", skip_invalid=True)


@pytest.mark.parametrize("declared", [True, False], ids=["declared-length", "no-length"])
def test_an_image_url_larger_than_the_byte_limit_is_refused_naming_it(tmp_path, monkeypatch, declared):
    """A declared Content-Length past the limit is refused before any of the body is read (the server here
    sends four bytes and then holds the connection open for 10 s); a body without one is read no further
    than the limit (set to 100 kB here: the server would send 2 MB)."""
    limit = 100_000
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", limit, raising=False)
    release = threading.Event()

    class Large(QuietHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            if declared:
                self.send_header("Content-Length", str(200_000_000))
                self.end_headers()
                self.wfile.write(b"\x89PNG")
                release.wait(10)
                return
            self.end_headers()  # HTTP/1.0, no length: the body ends when the connection closes
            try:
                self.wfile.write(b"\x89PNG\r\n\x1a\n" + bytes(2_000_000))
            except OSError:
                pass

    with loopback_http(Large) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/large.png"
        started = time.monotonic()
        try:
            with pytest.raises(DataError) as e:
                prepare("counting", str(image_url_rows(tmp_path, url)), tmp_path / "out", heldout=0)
        finally:
            release.set()
        took = time.monotonic() - started
    assert f"{url}: larger than the 100,000-byte limit of an image (data.images.MAX_IMAGE_BYTES)" in str(
        e.value
    )
    if declared:
        assert "the server declares 200,000,000 bytes" in str(e.value)
        assert took < 5, f"{took:.1f} s: the body was waited for"
    else:
        assert "the server sent more" in str(e.value)


def test_an_image_declaring_too_many_pixels_is_refused_before_it_is_decoded(tmp_path):
    """A 12000 x 12000 PNG is 17 kB on disk and over 400 MB decoded to RGB: prep refuses it from its header,
    naming the file and the pixel limit, and its peak memory (measured in a fresh interpreter) stays small."""
    from PIL import Image

    Image.new("1", (12000, 12000)).save(tmp_path / "huge.png")
    assert (tmp_path / "huge.png").stat().st_size < 100_000
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"image": "huge.png", "count": 1}) + "\n")
    code = (
        "import resource, sys\n"
        "import PIL.Image, PIL.PngImagePlugin\n"
        "from data.prepare import DataError, prepare\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n    prepare('counting', sys.argv[1], sys.argv[2], heldout=0)\n"
        "except DataError as e:\n    print(e)\n"
        "print('peak growth KiB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(src), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *message, growth = done.stdout.strip().splitlines()
    message = "\n".join(message)
    assert f"rows.jsonl:1: field 'image': expected an image within limits; {tmp_path / 'huge.png'}" in message
    assert (
        "declares more pixels than the 25,000,000-pixel limit of an image (data.images.MAX_IMAGE_PIXELS): "
        "it is 12000 x 12000" in message
    )
    assert int(growth.split()[-1]) < 100 * 1024, growth
    assert not (tmp_path / "out").exists()


def test_synthetic_rows_past_the_limit_are_refused_naming_the_field(tmp_path):
    from trainer.recipe import ConfigError, load_recipe

    assert load_recipe(None, ["data.synthetic_rows=1000000"]).data.synthetic_rows == 1_000_000
    with pytest.raises(
        ConfigError, match=r"data.synthetic_rows: must be <= 1,000,000, got 1000000000000000019"
    ):
        load_recipe(None, ["data.synthetic_rows=1e30"])
    with pytest.raises(DataError, match=r"synthetic_rows must be between 1 and 1,000,000, got 1000001"):
        prepare("synthetic", "synthetic", tmp_path / "out", synthetic_rows=1_000_001)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "prep",
            "--out",
            str(tmp_path / "out"),
            "data.synthetic_rows=1e30",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "data.synthetic_rows: must be <= 1,000,000" in done.stderr
    assert not (tmp_path / "out").exists()


def test_synthetic_addition_keeps_the_generators_evaluation_pool_held_out(tmp_path):
    result = prepare("synthetic", "synthetic", tmp_path / "out", synthetic_rows=300, seed=1)
    assert result["rows"]["train"] + result["rows"]["heldout"] == 300
    m = manifest(tmp_path / "out")
    assert m["split_by"] == "source" and m["source"]["generator"] == "addition"
    for split, in_pool in (("train", False), ("heldout", True)):
        for row in load_prepared(tmp_path / "out", split):
            a, b = (int(t) for t in user_text(row).removeprefix("What is ").removesuffix("?").split(" + "))
            assert row["answer"] == str(a + b) and in_eval_pool(a, b) is in_pool
    again = prepare("synthetic", "synthetic", tmp_path / "again", synthetic_rows=300, seed=1)
    assert again["sha256"] == result["sha256"]


def _countdown_solution(nums: list[int], target: int) -> str | None:
    """An expression using every number once with + - * / that equals `target` exactly, or None (brute
    force)."""

    def build(items: list[tuple[Fraction, str]]):
        if len(items) == 1:
            yield items[0]
            return
        for i, j in permutations(range(len(items)), 2):
            (a, x), (b, y) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            options = [(a + b, f"({x} + {y})"), (a - b, f"({x} - {y})"), (a * b, f"({x} * {y})")]
            if b != 0:
                options.append((a / b, f"({x} / {y})"))
            for option in options:
                yield from build([*rest, option])

    for value, text in build([(Fraction(n), str(n)) for n in nums]):
        if value == target:
            return text
    return None


def test_synthetic_countdown_through_the_countdown_adapter(tmp_path):
    summary = prepare("countdown", "synthetic:countdown", tmp_path / "out", synthetic_rows=20, heldout=0.2)
    rows = load_prepared(tmp_path / "out") + load_prepared(tmp_path / "out", split="heldout")
    assert len(rows) == 20 == summary["rows"]["train"] + summary["rows"]["heldout"]
    for row in rows:
        assert row["answer"] == str(row["target"]) and len(row["nums"]) == 3
        # every target is reachable: an exhaustive search over the three numbers finds an expression, and the
        # countdown reward, given that expression as a completion, scores it 1
        expression = _countdown_solution(row["nums"], row["target"])
        assert expression is not None, f"no expression over {row['nums']} reaches {row['target']}"
        completion = f"<think>search</think><answer>{expression}</answer>"
        assert countdown_reward([row["prompt"]], [completion], [row["nums"]], [row["target"]]) == [1.0]
    with pytest.raises(DataError, match="unknown synthetic kind 'chess'"):
        prepare("synthetic", "synthetic:chess", tmp_path / "x")


# --- adapters, directly ---


def test_numina_ignores_messages_and_reads_the_boxed_answer():
    ex = numina(
        {"problem": "2+2?", "solution": "Thus \\boxed{4}.", "messages": [{"role": "user", "content": "x"}]}
    )
    assert (ex.question, ex.answer, ex.columns) == ("2+2?", "4", {})


# --- user errors ---


def test_unknown_task_lists_the_valid_ones(tmp_path):
    with pytest.raises(
        DataError,
        match="unknown task 'gsm9k'; valid tasks: countdown, counting, gsm8k, math, numina, synthetic",
    ):
        prepare("gsm9k", "synthetic", tmp_path / "out")


@pytest.mark.parametrize("source", ["no/such/dir", "missing.jsonl", "./data-dir"])
def test_missing_local_path_is_not_a_hub_lookup(tmp_path, source):
    with pytest.raises(DataError, match=f"source not found: {source}"):
        prepare("gsm8k", source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hub_id_without_network_fails_at_once_naming_the_id(tmp_path, monkeypatch):
    # Port 9 on localhost refuses connections: the same answer everywhere, with or without a network.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(DataError, match="hub dataset 'openai/gsm8k'.*local --source"):
        prepare("gsm8k", "openai/gsm8k", tmp_path / "out", hub_config="main")
    assert not (tmp_path / "out").exists()


def test_hub_id_in_offline_mode_goes_through_load_dataset(tmp_path):
    """HF_HUB_OFFLINE is read when `datasets` is imported, hence a fresh interpreter."""
    code = (
        "from data.prepare import prepare, DataError\n"
        "try:\n    prepare('gsm8k', 'grpoflow-tests/not-cached', 'out')\n"
        "except DataError as e:\n    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert "hub dataset 'grpoflow-tests/not-cached', split 'train'" in done.stdout, done.stderr
    assert "local --source" in done.stdout


# --- reading a prepared directory back ---


def test_load_prepared_checks_the_manifest(tmp_path):
    with pytest.raises(DataError, match="no manifest.json"):
        load_prepared(tmp_path)
    prepare("synthetic", "synthetic", tmp_path / "out", synthetic_rows=50)
    with pytest.raises(DataError, match="no split 'test'; it has heldout, train"):
        load_prepared(tmp_path / "out", "test")
    train = tmp_path / "out" / "train.jsonl"
    train.write_text("".join(train.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(DataError, match="changed after it was prepared"):
        load_prepared(tmp_path / "out")


# ==========================================================================================================
# User input to `grpoflow prep`: exit 2 naming file and value; a read-only or full disk
# ==========================================================================================================
# Every command runs as a real `grpoflow` subprocess; read-only and full file systems are real tmpfs
# mounts in a private mount namespace.


def in_tmpfs(mountpoint: Path, options: str) -> list[str]:
    """A command prefix running the command in a private mount namespace with a real tmpfs at `mountpoint`
    (`unshare -m` as root, `unshare -rm` otherwise); the mount disappears with the process. After the command,
    what is left in the tmpfs is printed to stderr as `LEFT:<names>`."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = (
        'mount -t tmpfs -o "$1" tmpfs "$0" || exit 97; shift; "$@"; rc=$?; '
        'echo "LEFT:$(ls -A "$0" | tr "\\n" " ")" >&2; exit $rc'
    )
    return [*unshare, "sh", "-c", script, str(mountpoint), options]


def _gsm8k_rows(n: int = 20) -> list[dict]:
    return [
        {
            "question": f"Tom has {i} apples and buys {i} more. How many now?",
            "answer": f"He has {i} + {i} = {2 * i}.\n#### {2 * i}",
        }
        for i in range(1, n + 1)
    ]


def test_prep_without_task_is_refused_for_a_file_and_inferred_for_the_generator(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows()))
    proc = grpoflow_run("prep", "--source", str(source), "--out", str(tmp_path / "out"))
    line = one_line_error(proc, "prep")
    assert f"data: task: required for source '{source}' (prep --task, or data.task)" in line
    assert "gsm8k" in line
    assert not (tmp_path / "out").exists()
    proc = grpoflow_run(
        "prep", "--source", "synthetic:addition", "--out", str(tmp_path / "syn"), "data.synthetic_rows=40"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "syn" / "manifest.json").read_text())["task"] == "synthetic"


def test_prep_heldout_that_is_neither_fraction_nor_count_is_refused(tmp_path):
    proc = grpoflow_run(
        "prep",
        "--task",
        "synthetic",
        "--source",
        "synthetic:addition",
        "--heldout",
        "1.5",
        "--out",
        str(tmp_path / "out"),
    )
    line = one_line_error(proc, "prep")
    assert "heldout: 1.5 is neither a fraction in (0, 1) nor a whole number of rows" in line


def test_prep_latin1_csv_and_corrupt_parquet_are_exit_2_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    latin1 = tmp_path / "latin1.csv"
    latin1.write_text(
        "question,answer\n" + "".join(f"Café {i}: how much?,It costs {i} #### {i}\n" for i in range(1, 11)),
        encoding="latin-1",
    )
    line = one_line_error(
        grpoflow_run("prep", "--task", "gsm8k", "--source", str(latin1), "--out", str(tmp_path / "a")), "prep"
    )
    assert f"{latin1}:2: not UTF-8 text (byte 0xe9" in line and "save the file as UTF-8" in line

    rows = _gsm8k_rows(2000)
    good = tmp_path / "good.parquet"
    pq.write_table(
        pa.table({k: [r[k] + " " * 200 for r in rows] for k in ("question", "answer")}),
        good,
        data_page_size=4096,
        compression="NONE",
    )
    data = bytearray(good.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 3000] = b"A" * 3000  # a damaged page in the middle, footer intact
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(bytes(data))
    line = one_line_error(
        grpoflow_run("prep", "--task", "gsm8k", "--source", str(corrupt), "--out", str(tmp_path / "b")),
        "prep",
    )
    assert f"{corrupt}: unreadable Parquet data after row" in line and "damaged or truncated" in line


def test_prep_reads_a_csv_with_a_byte_order_mark(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(
        b"\xef\xbb\xbfquestion,answer\n"
        + b"".join(f"What is {i} + {i}?,{i} + {i} = {2 * i} #### {2 * i}\n".encode() for i in range(1, 11))
    )
    proc = grpoflow_run(
        "prep", "--task", "gsm8k", "--source", str(bom), "--out", str(tmp_path / "out"), "--json"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert last_json(proc)["rows"] == {"train": 9, "heldout": 1}
    first = json.loads((tmp_path / "out" / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"][-1]["content"].startswith("What is") and first["answer"].isdigit()


def test_prep_out_on_a_read_only_file_system_is_exit_2_naming_it(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = grpoflow_run(
        "prep",
        "--task",
        "synthetic",
        "--source",
        "synthetic:addition",
        "data.synthetic_rows=40",
        "--out",
        str(mnt / "sub" / "out"),
        "--json",
        prefix=in_tmpfs(mnt, "ro,size=64k"),
    )
    line = one_line_error(proc, "prep")
    assert f"--out {mnt / 'sub' / 'out'}: cannot write in {mnt} (read-only file system)" in line
    assert last_json(proc) == {"error": line.split(": error: ", 1)[1], "exit_code": 2}


def test_a_full_disk_is_reported_as_disk_full_and_leaves_nothing_behind(tmp_path):
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows(400)))  # ~60 kB prepared
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = mnt / "out"
    proc = grpoflow_run(
        "prep",
        "--task",
        "gsm8k",
        "--source",
        str(source),
        "--out",
        str(out),
        "--json",
        prefix=in_tmpfs(mnt, "size=16k"),
    )
    line = one_line_error(proc, "prep", code=1)
    assert f"disk full (no space left on device) writing: {out}" in line
    assert last_json(proc)["exit_code"] == 1
    assert re.search(r"^LEFT:$", proc.stderr, re.M), proc.stderr[-500:]  # no half-written directory left


# --- every source format and encoding, generated (hypothesis) ---

# Text a row may hold: any character UTF-8 carries (controls, NUL, quotes, commas, CR, U+2028, astral
# planes), and now and then a field past csv's default limit of 128 KiB.
_TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
_HUGE = st.integers(131_073, 160_000).map(lambda n: ("long " * n)[:n])
_PROBLEM = st.integers(0, 9).flatmap(lambda k: _HUGE if k == 0 else _TEXT).filter(str.strip)
_ROWS = st.lists(
    st.fixed_dictionaries(
        {"problem": _PROBLEM, "answer": st.text("0123456789abcxyz-/.", min_size=1, max_size=6)}
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda row: row["problem"].strip(),
)
_FORMATS = ("jsonl", "json", "csv", "parquet")
# what the reader must read: UTF-8 with and without a byte-order mark, UTF-16 and UTF-32 with one
_ENCODINGS = ("utf-8", "utf-8-sig", "utf-16", "utf-32")


def _source_bytes(rows: list[dict], fmt: str, encoding: str, crlf: bool, ascii_only: bool) -> bytes:
    """`rows` as the file a user's tool would write: JSON lines, a JSON array, CSV or Parquet."""
    end = "\r\n" if crlf else "\n"
    if fmt == "parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        return buffer.getvalue()
    if fmt == "csv":
        import csv
        import io

        text = io.StringIO()
        writer = csv.DictWriter(text, ["problem", "answer"], lineterminator=end)
        writer.writeheader()
        writer.writerows(rows)
        return text.getvalue().encode(encoding)
    if fmt == "json":  # an indented array; json.dumps escapes every newline inside a string
        text = json.dumps(rows, ensure_ascii=ascii_only, indent=1).replace("\n", end) + end
    else:
        text = "".join(json.dumps(row, ensure_ascii=ascii_only) + end for row in rows)
    return text.encode(encoding)


def _prepared(rows: list[dict]) -> list[tuple[str, str]]:
    return [(row["problem"].strip(), row["answer"]) for row in rows]


def _read_back(out: Path) -> list[tuple[str, str]]:
    return [(user_text(row), row["answer"]) for row in load_prepared(out, "train")]


@given(
    rows=_ROWS,
    fmt=st.sampled_from(_FORMATS),
    encoding=st.sampled_from(_ENCODINGS),
    crlf=st.booleans(),
    ascii_only=st.booleans(),
)
def test_generated_rows_are_read_alike_in_every_format_and_encoding(rows, fmt, encoding, crlf, ascii_only):
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"rows.{fmt}"
        source.write_bytes(_source_bytes(rows, fmt, encoding, crlf, ascii_only))
        result = prepare("math", str(source), Path(tmp) / "out", heldout=0)
        assert result["dropped"] == {}
        assert _read_back(Path(tmp) / "out") == _prepared(rows)


# Lines no reader may crash on: a number past Python's 4300-digit limit, nesting past the recursion limit,
# a lone surrogate escape (no UTF-8 file can hold it), bytes that are not UTF-8, a row with an extra cell.
_HOSTILE = (
    b'{"problem": "x", "answer": ' + b"9" * 5000 + b"}",
    b"[" * 100_000,
    b'{"problem": "\\ud800 alone", "answer": "1"}',
    b"\xff\xfe not text",
    b"extra,cells,here",
    b'"an open quote',
    b"\x00",
)
_VALID = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "What is 2 + 3?", "answer": "5"}]


@settings(max_examples=100)
@given(
    rows=_ROWS,
    fmt=st.sampled_from(_FORMATS),
    garbage=st.one_of(st.sampled_from(_HOSTILE), st.binary(min_size=1, max_size=40)),
    skip_invalid=st.booleans(),
)
@example(rows=_VALID, fmt="jsonl", garbage=_HOSTILE[0], skip_invalid=False)
@example(rows=_VALID, fmt="jsonl", garbage=_HOSTILE[1], skip_invalid=False)
@example(rows=_VALID, fmt="jsonl", garbage=_HOSTILE[2], skip_invalid=False)
@example(rows=_VALID, fmt="json", garbage=_HOSTILE[0], skip_invalid=True)
@example(rows=_VALID, fmt="csv", garbage=_HOSTILE[4], skip_invalid=False)
def test_trailing_garbage_is_refused_naming_the_file_and_loses_no_valid_row(rows, fmt, garbage, skip_invalid):
    """Whatever follows the valid rows: the run stops with a DataError naming the file (and the line or row
    where it can), or every valid row is kept, in order, and what is dropped is counted."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"rows.{fmt}"
        source.write_bytes(_source_bytes(rows, fmt, "utf-8", False, True) + garbage + b"\n")
        try:
            result = prepare("math", str(source), Path(tmp) / "out", heldout=0, skip_invalid=skip_invalid)
        except DataError as e:
            assert str(source) in str(e), e
            if fmt != "parquet":  # a damaged Parquet footer has no row to name
                assert re.search(rf"{re.escape(str(source))}(:\d+| row \d+)", str(e)), e
            return
        kept = _read_back(Path(tmp) / "out")
        assert kept[: len(rows)] == _prepared(rows)
        assert skip_invalid or not result["dropped"]
