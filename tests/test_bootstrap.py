"""The embedded default's tiny base model: real tokenizer training, real warm-up, real HF save/load."""

from __future__ import annotations

import json
import time

import torch

from trainer.bootstrap import bootstrap


def test_bootstrap_lands_in_target_band_and_loads_like_a_hub_model(tiny_base, tiny_recipe):
    lo, hi = tiny_recipe.bootstrap.target_accuracy
    assert 0.2 <= lo and hi <= 0.7
    assert lo <= tiny_base["heldout_accuracy"] <= hi
    assert tiny_base["heldout_format_rate"] > 0.9

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base["path"])
    model = AutoModelForCausalLM.from_pretrained(tiny_base["path"])
    assert model.config.model_type == "qwen2" and 0.5e6 < model.num_parameters() < 2e6
    # the tags are single, non-special tokens: they survive decoding
    ids = tok("<think>1+2=3</think><answer>3</answer>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "<think>" and len(ids) == 10  # 4 tags + 6 characters
    assert tok.decode(ids, skip_special_tokens=True) == "<think>1+2=3</think><answer>3</answer>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    # greedy generation through plain transformers gives the think/answer format
    prompt = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    completion = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert completion.startswith("<think>") and "</answer>" in completion

    with open(tiny_base["manifest"]) as f:
        manifest = json.load(f)
    assert (
        manifest["kind"] == "base-model"
        and manifest["history"][-1]["accuracy"] == tiny_base["heldout_accuracy"]
    )


def test_second_call_is_a_cache_hit_and_config_change_is_not(tiny_base, tiny_recipe):
    started = time.time()
    again = bootstrap(
        tiny_recipe.bootstrap, out=tiny_base["path"], system_prompt=tiny_recipe.data.system_prompt
    )
    assert again["cached"] is True and again["heldout_accuracy"] == tiny_base["heldout_accuracy"]
    assert time.time() - started < 30  # no training happened (it takes minutes)
    from trainer.bootstrap import config_hash

    changed = type(tiny_recipe.bootstrap)(**{**tiny_recipe.bootstrap.__dict__, "seed": 1})
    assert config_hash(changed, "x") != config_hash(tiny_recipe.bootstrap, "x")


def test_deterministic_given_seed(tiny_recipe, tmp_path):
    """Same config, same first warm-up steps: compare a short warm-up twice (a full one takes minutes)."""
    from trainer.bootstrap import _corpus, _rows, build_model, build_tokenizer, sft_batches

    cfg = tiny_recipe.bootstrap
    losses = []
    for _ in range(2):
        rows = _rows(cfg.task, 256, cfg.seed, "train", "brief")
        tok = build_tokenizer(_corpus(rows, "brief"), cfg.vocab_size)
        model = build_model(cfg, tok)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
        batches = sft_batches(model, tok, rows, 32, cfg.seed)
        run = []
        for _ in range(3):
            ids, mask, labels, extra = next(batches)
            assert extra == {}  # a text model's batches have nothing but tokens
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == losses[1]


def test_a_second_maker_waits_for_the_first_then_takes_its_model(tiny_base, tiny_recipe, tmp_path):
    """Two makers at once (two `make run`s, two test workers): the second waits on the lock the first holds,
    then returns the first's model as a cache hit instead of warming up its own."""
    import fcntl
    import shutil
    import threading

    out = tmp_path / "models" / "tiny-base"
    out.parent.mkdir()
    results = []
    with open(out.parent / f".{out.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a first maker holds while it warms up
        second = threading.Thread(
            target=lambda: results.append(
                bootstrap(
                    tiny_recipe.bootstrap,
                    out=out,
                    system_prompt=tiny_recipe.data.system_prompt,
                    progress=False,
                )
            )
        )
        second.start()
        second.join(timeout=2)
        assert (
            second.is_alive() and results == []
        )  # waiting, neither warming up nor reading a half-made model
        shutil.copytree(tiny_base["path"], out)  # the first maker's model lands
    second.join(timeout=60)
    assert results and results[0]["cached"] is True and results[0]["path"] == str(out)
    assert results[0]["heldout_accuracy"] == tiny_base["heldout_accuracy"]
