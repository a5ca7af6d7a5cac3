"""The `grpoflow` command line: one subcommand per stage, each with `--json` for scripts and CI.

With `--json`, the last line printed on stdout is one JSON object whose keys are stable; progress and
logs go to stderr. Exit status: 0 success, 1 a failure while running, 2 bad input (config, data, usage).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"


class UsageError(ValueError):
    """Bad input from the user: exit status 2."""


def _recipe(args, extra_overrides: list[str] = ()):
    from trainer.recipe import load_recipe

    config = args.config
    if config is None and getattr(args, "default_config", None):
        config = args.default_config
    return load_recipe(config, list(extra_overrides) + list(args.overrides))


def cmd_prep(args) -> dict:
    from data.prepare import prepare

    flags = {"task": args.task, "source": args.source, "out": args.out, "seed": args.seed,
             "heldout": args.heldout, "limit": args.limit, "split": args.split, "hub_config": args.hub_config,
             "system_prompt": args.system_prompt}
    overrides = [f"data.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    if args.skip_invalid:
        overrides.append("data.skip_invalid=true")
    result = prepare(**_recipe(args, overrides).data.prepare_kwargs())
    _say(args, f"prepared {result['rows']['train']} train + {result['rows']['heldout']} held-out rows "
               f"into {result['out']}" + (f" (dropped: {result['dropped']})" if result["dropped"] else ""))
    return result


def cmd_bootstrap(args) -> dict:
    from trainer.bootstrap import bootstrap

    recipe = _recipe(args, [f"bootstrap.out={json.dumps(args.out)}"] if args.out else [])
    result = bootstrap(recipe.bootstrap, system_prompt=recipe.data.system_prompt)
    _say(args, f"tiny base model at {result['path']}: held-out greedy accuracy {result['heldout_accuracy']:.3f} "
               f"after {result['warmup_steps']} warm-up steps" + (" (cached)" if result["cached"] else ""))
    return result


def cmd_train(args) -> dict:
    from trainer.grpo import train_recipe

    result = train_recipe(_recipe(args))
    before, after = result["heldout_accuracy_before"], result["heldout_accuracy_after"]
    if before is not None:
        _say(args, f"held-out greedy accuracy: {before:.3f} before, {after:.3f} after {result['steps']} steps "
                   f"({result['seconds_per_step']:.2f} s/step); checkpoint {result['checkpoint']}")
    return result


def cmd_run(args) -> dict:
    from tasks.services import configure

    services = configure(args.state_dir)
    recipe = _recipe(args)
    from flows.pipeline import grpo_pipeline  # after configure(): Prefect reads its settings at import

    summary = grpo_pipeline(recipe.to_dict(), {"tracking_uri": services.tracking_uri,
                                               "registry_uri": services.registry_uri,
                                               "artifact_root": services.artifact_root})
    summary["state"] = services.describe()
    summary["ui"] = services.ui_commands()
    if not args.json:
        from flows.report import print_run_summary
        print_run_summary(summary)
    return summary


def cmd_eval(args) -> dict:
    from tasks.services import configure

    services = configure(args.state_dir)
    recipe = _recipe(args)
    from evaluation import run_evalscope
    from tasks import tracking
    from tasks.evaluation import heldout_accuracy, record_evaluation, resolve_model

    client = tracking.client_for(services.tracking_uri, services.registry_uri)
    ref = resolve_model(args.model, client, services.state_dir / "models-cache")
    e = recipe.eval
    name = ref.model_name and f"{ref.model_name}-v{ref.model_version}" or Path(ref.local_path or "endpoint").name
    result = run_evalscope(ref.local_path or args.served_model_name or "default", e.benchmarks,
                           work_dir=Path(e.out).resolve() / name, local_paths=e.local_paths or None, limit=e.limit,
                           repeats=e.repeats, max_tokens=e.max_tokens, temperature=e.temperature,
                           api_url=ref.api_url, api_key_env=args.api_key_env)
    scores = dict(result.scores)
    if ref.local_path and (acc := heldout_accuracy(ref.local_path, recipe.data.out, recipe)) is not None:
        scores["heldout_accuracy"] = acc
    experiment = tracking.ensure_experiment(client, recipe.registry.experiment, services.artifact_root)
    run_id = record_evaluation(client, experiment, ref, scores, recipe.to_dict()["eval"], result.work_dir / "report.json")
    for bench, score in scores.items():
        _say(args, f"{bench}: {score:.4f}")
    return {"model": args.model, "model_name": ref.model_name, "model_version": ref.model_version,
            "scores": scores, "num_samples": result.num_samples, "report": str(result.work_dir / "report.json"),
            "work_dir": str(result.work_dir), "mlflow_run_id": run_id, "tracking_uri": services.tracking_uri}


def _say(args, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _add_recipe_args(p: argparse.ArgumentParser, default_config: Path | None) -> None:
    p.add_argument("--config", "-c", default=None,
                   help=f"recipe YAML (default: {default_config.relative_to(REPO_ROOT) if default_config else 'built-in defaults'})")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. train.learning_rate=1e-4")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(default_config=default_config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prep", help="turn a dataset into validated prompt/answer rows with a manifest")
    p.add_argument("--task", help="gsm8k, math, numina, countdown, counting, synthetic")
    p.add_argument("--source", help="JSONL/Parquet/CSV file or directory, HF hub id, or synthetic[:kind]")
    p.add_argument("--out", help="output directory")
    p.add_argument("--seed", type=int)
    p.add_argument("--heldout", type=float, help="fraction (<1) or row count (>=1) held out")
    p.add_argument("--limit", type=int, help="read at most this many rows")
    p.add_argument("--split", help="split of a hub dataset or directory (default train)")
    p.add_argument("--hub-config", help="hub dataset configuration")
    p.add_argument("--system-prompt", help="r1 (default), brief, none, or literal text")
    p.add_argument("--skip-invalid", action="store_true", help="drop malformed rows instead of failing")
    _add_recipe_args(p, None)
    p.set_defaults(func=cmd_prep)

    p = sub.add_parser("bootstrap-model", help="make the embedded default's tiny base model (cached)")
    p.add_argument("--out", help="output directory (default: the recipe's bootstrap.out)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("train", help="train a policy with GRPO (prepares data and the base model if missing)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint, a registered version or an endpoint with EvalScope")
    p.add_argument("model", help="checkpoint dir, models:/name@alias, models:/name/version, or http(s)://host/v1")
    p.add_argument("--served-model-name", help="model name at an OpenAI-compatible endpoint")
    p.add_argument("--api-key-env", help="environment variable holding the endpoint's API key")
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", help="the whole pipeline: prepare, train, register in MLflow, evaluate (Prefect flow)")
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpcore", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from data.errors import DataError
    from trainer.plugins import PluginError
    from trainer.rewards import RewardSpecError
    from trainer.typed_config import ConfigError

    try:
        result = args.func(args)
    except (ConfigError, DataError, RewardSpecError, PluginError, UsageError, FileNotFoundError) as e:
        print(f"grpoflow {args.command}: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e), "exit_code": 2}))
        return 2
    except KeyboardInterrupt:
        print(f"grpoflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's last word on any failure, with the traceback in the log
        logging.getLogger("grpoflow").exception("%s failed", args.command)
        if args.json:
            print(json.dumps({"error": f"{type(e).__name__}: {e}", "exit_code": 1}))
        return 1
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
