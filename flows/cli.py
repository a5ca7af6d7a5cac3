"""The `grpoflow` command line: one subcommand per stage, each with `--json` for scripts and CI.

With `--json`, the last line printed on stdout is one JSON object whose keys are stable, on every exit
(`{"error": ..., "exit_code": N}` when the command did not finish); progress and logs go to stderr.
Exit status: 0 success, 1 a failure while running, 2 bad input (config, data, flags, usage) or a service
that cannot be reached (one line naming it), 130 interrupted. Inputs are checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from data.errors import GrpoflowUserError, UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"


class _ArgumentError(Exception):
    """An argparse error, raised instead of argparse's own exit so that `--json` still prints its object."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise _ArgumentError(f"{self.prog}: error: {message}")


def number(kind: type = float, *, gt: float | None = None, ge: float | None = None, le: float | None = None):
    """An argparse `type` for a numeric flag: finite, and within the bounds given."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        for bound, ok, symbol in (
            (gt, lambda v, b: v > b, ">"),
            (ge, lambda v, b: v >= b, ">="),
            (le, lambda v, b: v <= b, "<="),
        ):
            if bound is not None and not ok(value, bound):
                raise argparse.ArgumentTypeError(f"must be {symbol} {bound:g}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _config(args):
    return args.config if args.config is not None else getattr(args, "default_config", None)


def _recipe(args, extra_overrides: list[str] = ()):
    from trainer.recipe import load_recipe

    return load_recipe(_config(args), list(extra_overrides) + list(args.overrides))


def _recipe_and_services(args):
    """The recipe with its outputs under --state-dir, and the services (Prefect reads its settings at import:
    this runs before any flow module is imported)."""
    from tasks.services import recipe_and_services

    return recipe_and_services(_config(args), args.overrides, args.state_dir)


def _source(args) -> str:
    """How an error names the recipe."""
    return str(args.config or args.default_config or "<defaults>")


def cmd_prep(args) -> dict:
    from data.prepare import prepare
    from tasks.preflight import check_writable

    flags = {
        "task": args.task,
        "source": args.source,
        "out": args.out,
        "seed": args.seed,
        "heldout": args.heldout,
        "limit": args.limit,
        "split": args.split,
        "hub_config": args.hub_config,
        "system_prompt": args.system_prompt,
    }
    overrides = [f"data.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    if args.skip_invalid:
        overrides.append("data.skip_invalid=true")
    kwargs = _recipe(args, overrides).data.prepare_kwargs()
    check_writable(kwargs["out"], "--out" if args.out else "data.out")
    result = prepare(**kwargs)
    _say(
        args,
        f"prepared {result['rows']['train']} train + {result['rows']['heldout']} held-out rows "
        f"into {result['out']}" + (f" (dropped: {result['dropped']})" if result["dropped"] else ""),
    )
    return result


def cmd_bootstrap(args) -> dict:
    from tasks.preflight import check_writable
    from trainer.bootstrap import bootstrap

    recipe = _recipe(args, [f"bootstrap.out={json.dumps(args.out)}"] if args.out else [])
    check_writable(recipe.bootstrap.out, "--out" if args.out else "bootstrap.out")
    result = bootstrap(recipe.bootstrap, system_prompt=recipe.data.system_prompt)
    _say(
        args,
        f"tiny base model at {result['path']}: held-out greedy accuracy {result['heldout_accuracy']:.3f} "
        f"after {result['warmup_steps']} warm-up steps" + (" (cached)" if result["cached"] else ""),
    )
    return result


def _memory_text(memory: dict) -> str:
    from trainer.memory_plan import device_label

    lines = [
        f"memory plan, GPUs of {memory['gpu_memory_gib']:g} GiB: "
        + ("fits" if memory["fits"] else "does NOT fit")
    ]
    lines += [
        f"  {device_label(d):<7} {d['role']:<9} {d['total_gib']:7.1f} GiB "
        + ("" if d["fits"] else "(over) ")
        + ", ".join(f"{k} {v:.1f}" for k, v in d["parts"].items() if v)
        for d in memory["devices"]
    ]
    return "\n".join(lines + [f"  note: {n}" for n in memory["notes"]])


def _environment_plan(env) -> dict | None:
    """The multi-turn environment a recipe trains in, its tools loaded (a tool that does not load is an error
    naming rollout.env.tools); None for single-turn training."""
    if env is None:
        return None
    from trainer.multiturn.tools import load_tool

    try:
        tools = [load_tool(spec).name for spec in env.tools]
    except Exception as e:  # noqa: BLE001 - any failure to load a user's tool is the recipe's error
        raise UsageError(f"rollout.env.tools: {e}") from None
    return {
        "name": env.name,
        "tools": tools,
        "max_turns": env.max_turns,
        "tool_timeout_s": env.tool_timeout_s,
    }


def cmd_train(args) -> dict | None:
    recipe = _recipe(args)
    for flag, value in (("--gpus", args.gpus), ("--gpu-memory-gib", args.gpu_memory_gib)):
        if value is not None and not args.dry_run:
            raise UsageError(f"{flag} plans a node for --dry-run; a real run uses the GPUs it sees")
    if args.dry_run:  # where each process would run and what its GPU holds; nothing is loaded, no GPU touched
        from trainer.memory_plan import estimate, refuse_unless_fits
        from trainer.placement import dry_run
        from trainer.strategy import check_recipe

        # a mode the trainer ranks would refuse (LoRA under ZeRO) has no memory plan either; a recipe refused
        # for its engine (images and vLLM) still shows where its processes would run
        check_recipe(recipe)
        summary, text = dry_run(recipe.rollout, args.gpus)
        _say(args, f"{recipe.name}: {text}")
        memory = estimate(recipe, args.gpus, args.gpu_memory_gib or 80.0)
        _say(args, _memory_text(memory))
        refuse_unless_fits(recipe, memory)
        env = _environment_plan(recipe.rollout.env)
        if env is not None:
            _say(args, f"environment: {env['name']}, tools {env['tools']}, at most {env['max_turns']} turns")
        return {"dry_run": True, "recipe": recipe.name, **summary, "env": env, "memory": memory}
    from trainer.grpo import prepare_inputs, train_recipe
    from trainer.launch import launch_node, launch_ranks, needs_launch

    nodes = recipe.rollout.nodes
    if "WORLD_SIZE" not in os.environ and (nodes > 1 or args.node_rank is not None or args.rendezvous):
        if nodes == 1 or args.node_rank is None or not args.rendezvous:
            raise UsageError(
                f"rollout.nodes is {nodes}: --node-rank and --rendezvous HOST:PORT go together with "
                "rollout.nodes > 1 (the same command on every node, each with its own --node-rank)"
            )
        if args.node_rank == 0:  # data and base model once, on the shared disk, before any node trains
            prepare_inputs(recipe)
        code = launch_node(recipe, sys.argv[sys.argv.index("train") + 1 :], args.node_rank, args.rendezvous)
        if code:
            raise RuntimeError(f"node {args.node_rank}'s trainer ranks exited with status {code}")
        return None  # trainer rank 0 printed the summary
    if needs_launch(recipe):  # data and base model first, once, then the trainer ranks
        prepare_inputs(recipe)
        code = launch_ranks(recipe, sys.argv[sys.argv.index("train") + 1 :])
        if code:
            raise RuntimeError(f"trainer ranks exited with status {code}")
        return None  # rank 0 printed the summary
    result = train_recipe(recipe)
    if result is None:  # a trainer rank other than 0
        return None
    before, after = result["heldout_accuracy_before"], result["heldout_accuracy_after"]
    if before is not None:
        _say(
            args,
            f"held-out greedy accuracy: {before:.3f} before, {after:.3f} after {result['steps']} steps "
            f"({result['seconds_per_step']:.2f} s/step); checkpoint {result['checkpoint']}",
        )
    return result


def cmd_join(args) -> None:
    """A node other than 0 of a multi-node run whose recipe is node 0's (the pipeline's train stage there):
    waits for node 0's rendezvous while the flow run (PREFECT__FLOW_RUN_ID, or --flow-run) has not ended."""
    from trainer.launch import join_node

    flow_run_id = args.flow_run or os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run_id and not os.environ.get("PREFECT_API_URL"):
        if args.flow_run:
            raise UsageError("--flow-run: its state is read from PREFECT_API_URL, which is not set")
        flow_run_id = None  # a flow run's id without its API: wait for node 0 within --wait-s alone

    def recipe_of(cli_args: list[str]):
        return _recipe(build_parser().parse_args(["train", *cli_args]))

    code = join_node(
        args.node_rank,
        args.rendezvous,
        args.wait_s,
        (lambda: _flow_run_ended(flow_run_id)) if flow_run_id else (lambda: None),
        recipe_of,
    )
    if code:
        raise RuntimeError(f"node {args.node_rank}'s trainer ranks exited with status {code}")
    return None  # trainer rank 0, on node 0, reports the run


def _flow_run_ended(flow_run_id: str) -> str | None:
    """Why a joining node should stop waiting: the flow run has ended (its state), else None; an API that does
    not answer (bounded by PREFECT_API_REQUEST_TIMEOUT) counts as not ended."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception as e:  # noqa: BLE001 - the API away for a while: keep waiting, within --wait-s
        logging.getLogger("grpoflow.join").warning("flow run %s: state unknown (%s)", flow_run_id, e)
        return None
    if state is not None and state.is_final():
        return f"flow run {flow_run_id} ended ({state.name}) before its training started"
    return None


def cmd_run(args) -> dict:
    recipe, services = _recipe_and_services(args)
    from flows.pipeline import run_pipeline  # after configure(): Prefect reads its settings at import

    summary = run_pipeline(recipe, services, _source(args))
    summary["state"] = services.describe()
    summary["ui"] = services.ui_commands()
    if not args.json:
        from flows.report import print_run_summary

        print_run_summary(summary)
    return summary


def cmd_eval(args) -> dict:
    recipe, services = _recipe_and_services(args)
    if args.api_key_env and not os.environ.get(args.api_key_env):
        raise UsageError(
            f"--api-key-env {args.api_key_env}: the environment variable {args.api_key_env} is not "
            "set (or empty)"
        )
    from tasks.evaluation import evaluate_reference

    result = evaluate_reference(
        args.model,
        recipe,
        services,
        source=_source(args),
        serve=args.serve,
        served_model_name=args.served_model_name,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        serve_engine=args.serve_engine,
        work_dir=args.work_dir,
    )
    for bench, score in result["scores"].items():
        _say(args, f"{bench}: {score:.4f}")
    return result


def cmd_serve_model(args) -> dict:
    from evaluation.serving import ServingInputError, serve_from_args

    try:
        return serve_from_args(args, lambda text: _say(args, text))
    except ServingInputError as e:
        raise UsageError(str(e)) from e


def cmd_thinking(args) -> dict:
    from evaluation.thinking import OpenAIJudge, analyze, format_table

    judge = None
    if args.judge_url:
        if not args.judge_model:
            raise UsageError("--judge-url needs --judge-model (the model name the endpoint serves)")
        try:
            judge = OpenAIJudge(args.judge_url, args.judge_model, api_key_env=args.judge_api_key_env)
        except ValueError as e:
            raise UsageError(str(e)) from e
    summary = analyze(args.path, args.tokenizer, out=args.out, judge=judge).summary
    _say(args, f"{format_table(summary)}\nper-sample rows: {summary['samples_path']}")
    return summary


def cmd_compare(args) -> dict:
    result = _comparison(args, args.baseline, args.candidate)
    _say(args, result["table"] + f"\nplot: {result['plot']} (MLflow run {result['mlflow_run_id']})")
    return result


def cmd_gate(args) -> dict:
    """The `regression-eval` flow's steps, without Prefect. Exit 0 when the candidate passes, 1 when a
    benchmark dropped by more than --max-drop with confidence, 2 for a broken check (input, MLflow, ...)."""
    from evaluation.compare import DEFAULT_MAX_DROP
    from tasks.comparison import CHAMPION

    max_drop = DEFAULT_MAX_DROP if args.max_drop is None else args.max_drop  # --max-drop's type checked it
    result = _comparison(
        args, args.baseline, args.candidate, max_drop=max_drop, promote_to=CHAMPION if args.promote else None
    )
    promoted = f"; {CHAMPION} -> {result['promoted']}" if result["promoted"] else ""
    _say(
        args,
        f"{result['table']}\n{result['gate']['report']}\nplot: {result['plot']} "
        f"(MLflow run {result['mlflow_run_id']}){promoted}",
    )
    return {**result, "exit_code": 0 if result["passed"] else 1}


def _comparison(args, baseline: str, candidate: str, **gate) -> dict:
    recipe, services = _recipe_and_services(args)
    from tasks.regression import run_comparison_for_command

    return run_comparison_for_command(baseline, candidate, recipe, services.flow_parameters(), **gate)


def cmd_recipe_explain(args) -> dict | None:
    from trainer.recipe_help import explain, render_markdown, render_text

    sections = explain(args.key)
    if args.markdown:  # printed as is: docs/recipe.md is this output
        print(render_markdown(sections), end="")
        return None
    _say(args, render_text(sections))
    return {"key": args.key, "fields": [doc.as_dict() for section in sections for doc in section.fields]}


def _say(args, text: str) -> None:
    from data.redact import redact

    print(redact(text), file=sys.stderr if args.json else sys.stdout, flush=True)


def _add_recipe_args(p: argparse.ArgumentParser, default_config: Path | None) -> None:
    p.add_argument(
        "--config",
        "-c",
        default=None,
        help="recipe YAML (default: "
        f"{default_config.relative_to(REPO_ROOT) if default_config else 'built-in defaults'})",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. train.learning_rate=1e-4"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(default_config=default_config)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpoflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prep", help="turn a dataset into validated prompt/answer rows with a manifest")
    p.add_argument("--task", help="gsm8k, math, numina, countdown, counting, synthetic")
    p.add_argument("--source", help="JSONL/Parquet/CSV file or directory, HF hub id, or synthetic[:kind]")
    p.add_argument("--out", help="output directory")
    p.add_argument("--seed", type=number(int))
    p.add_argument(
        "--heldout", type=number(float, ge=0), help="0, a fraction (<1) or a whole row count (>=1) held out"
    )
    p.add_argument("--limit", type=number(int, ge=1), help="read at most this many rows")
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
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print where each process would run (GPUs, CUDA_VISIBLE_DEVICES) and the memory plan of each "
        "GPU, and stop; touches no GPU and loads no model",
    )
    p.add_argument(
        "--gpus", type=number(int, ge=0), help="with --dry-run: plan for a node with this many GPUs"
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=number(float, gt=0),
        help="with --dry-run: the memory plan's GPU size in GiB (default 80); a recipe that does not fit "
        "is refused (exit 2) naming what to change",
    )
    p.add_argument(
        "--node-rank",
        type=number(int, ge=0),
        help="with rollout.nodes > 1: this node's rank (0 holds trainer rank 0 and the rollout); run the "
        "same command on every node, each with its own rank",
    )
    p.add_argument(
        "--rendezvous",
        metavar="HOST:PORT",
        help="with rollout.nodes > 1: node 0's address as the other nodes reach it and a port; the nodes "
        "meet there (and torchrun on PORT + 1) before training",
    )
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval", help="evaluate a checkpoint, a registered version or an endpoint with EvalScope"
    )
    p.add_argument(
        "model", help="checkpoint dir, models:/name@alias, models:/name/version, or http(s)://host/v1"
    )
    p.add_argument(
        "--served-model-name", help="model name at an OpenAI-compatible endpoint (or to --serve under)"
    )
    p.add_argument("--api-key-env", help="environment variable holding the endpoint's API key")
    p.add_argument(
        "--serve",
        action="store_true",
        help="serve the checkpoint on loopback (vLLM on a GPU, else transformers) and evaluate through it",
    )
    p.add_argument(
        "--serve-engine",
        choices=("auto", "transformers", "vllm"),
        default="auto",
        help="the engine --serve starts (default auto: vLLM when installed and a GPU is seen)",
    )
    p.add_argument(
        "--concurrency",
        type=number(int, ge=1),
        default=8,
        help="requests in flight against an endpoint (--serve or a URL; default 8)",
    )
    p.add_argument(
        "--work-dir",
        help="where the evaluation goes (default under eval.out: the model's name, or "
        "for a URL a new folder each time)",
    )
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_eval)

    from evaluation.serving import add_server_arguments

    p = sub.add_parser(
        "serve-model", help="serve a checkpoint behind an OpenAI-compatible endpoint until stopped"
    )
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve_model, streams_json=True)  # its ready line and summary, as they happen

    p = sub.add_parser("thinking", help="thinking-efficiency metrics of an EvalScope work dir or a JSONL")
    p.add_argument(
        "path", help="work dir of `grpoflow eval` (has report.json), or JSONL of {id, output, answer}"
    )
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer: checkpoint directory or hub id")
    p.add_argument(
        "--out", help="per-sample JSONL (default <work_dir>/thinking/samples.jsonl or <stem>.thinking.jsonl)"
    )
    p.add_argument("--judge-url", help="OpenAI-compatible endpoint of an LLM judge for free-form reasoning")
    p.add_argument("--judge-model", help="model name the judge endpoint serves")
    p.add_argument("--judge-api-key-env", help="environment variable holding the judge endpoint's API key")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(func=cmd_thinking)

    p = sub.add_parser(
        "join",
        help="a node other than 0 of a multi-node run started by the pipeline on node 0: joins its training",
    )
    p.add_argument("--node-rank", type=number(int, ge=1), required=True, help="this node's rank (1, 2, ...)")
    p.add_argument(
        "--rendezvous",
        metavar="HOST:PORT",
        required=True,
        help="node 0's address as this node reaches it and the port of its rendezvous (GRPOFLOW_RENDEZVOUS "
        "on node 0)",
    )
    p.add_argument(
        "--wait-s",
        type=number(float, gt=0),
        default=3600.0,
        help="how long to wait for node 0's training to start (default 3600); with a flow run "
        "(PREFECT__FLOW_RUN_ID, --flow-run) the wait also ends when the flow run does",
    )
    p.add_argument(
        "--flow-run", help="the flow run whose training this node joins (default $PREFECT__FLOW_RUN_ID)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser(
        "run", help="the whole pipeline: prepare, train, register in MLflow, evaluate (Prefect flow)"
    )
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "compare", help="compare two evaluated models problem by problem (paired bootstrap CIs)"
    )
    p.add_argument(
        "baseline", help="A: models:/name@alias, models:/name/version, a checkpoint, or an eval work dir"
    )
    p.add_argument("candidate", help="B, the same kinds; differences are B - A")
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "gate",
        help="regression gate: exit 1 when the candidate is worse than the baseline with "
        "confidence, 2 on errors",
    )
    p.add_argument("--candidate", required=True, help="models:/..., a checkpoint, or an eval work dir")
    p.add_argument("--baseline", required=True, help="models:/... (e.g. models:/grpoflow-tiny@champion), ...")
    p.add_argument(
        "--max-drop", type=number(float, ge=0), help="allowed drop in a benchmark's score (default 0.02)"
    )
    p.add_argument(
        "--promote", action="store_true", help="on a pass, set the 'champion' alias on the candidate"
    )
    p.add_argument("--state-dir", help="where the embedded stores live (default .state, or $GRPOFLOW_STATE)")
    _add_recipe_args(p, DEFAULT_CONFIG)
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("recipe", help="what a recipe's fields mean")
    actions = p.add_subparsers(dest="recipe_command", metavar="explain", required=True)
    p = actions.add_parser("explain", help="each field's type, default, bounds and help")
    p.add_argument(
        "key", nargs="?", help="a field (train.learning_rate) or a section (rollout); default: all"
    )
    output = p.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="the reference table of docs/recipe.md")
    output.add_argument(
        "--json", action="store_true", help="print the fields as JSON as the last line of stdout"
    )
    p.set_defaults(func=cmd_recipe_explain)

    from flows.deployments import add_commands  # deploy, serve

    add_commands(sub, number)
    return parser


def _parse(argv: list[str] | None):
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may come after options too (`eval CKPT --serve eval.limit=1`)
    late = [t for t in extra if "=" in t and not t.startswith("-")]
    if len(late) != len(extra) or (late and not hasattr(args, "overrides")):
        parser.error(
            "unrecognized arguments: "
            f"{' '.join(t for t in extra if t not in late or not hasattr(args, 'overrides'))}"
        )
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def _fail(args, message: str, code: int) -> int:
    """The one-line message on stderr, and with --json the error object on stdout."""
    from data.redact import redact

    print(redact(message), file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": redact(message.split(": error: ", 1)[-1]), "exit_code": code}))
    return code


_NOT_WRITABLE = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
# what ran out, and what to do about it
_NO_SPACE = {
    errno.ENOSPC: ("disk full (no space left on device)", "free some space"),
    errno.EDQUOT: ("disk quota exceeded", "free some space"),
    errno.EFBIG: ("file too large for a file size limit (the file system's, or `ulimit -f`)", "raise it"),
}


def _behind(e: BaseException) -> Iterator[BaseException]:
    """`e` and every exception behind it (its causes and the exceptions it was raised while handling)."""
    todo, seen = [e], set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            yield e
            todo += [e.__context__, e.__cause__]


def _storage_error(e: BaseException) -> OSError | None:
    """The OSError of a full or unwritable disk behind `e` (possibly wrapped by a library), else None."""
    storage = {**_NOT_WRITABLE, **_NO_SPACE}
    return next((x for x in _behind(e) if isinstance(x, OSError) and x.errno in storage), None)


def _interrupted(e: BaseException) -> bool:
    """Whether a Ctrl-C is behind `e`: a library stopping on one may fail on its way out, e.g. Prefect
    reporting the crash to its temporary server, which the terminal's SIGINT stopped too."""
    return any(isinstance(x, KeyboardInterrupt) for x in _behind(e))


def main(argv: list[str] | None = None) -> int:
    """The `grpoflow` command: its exit status. A trainer rank (its process group made in this process, which
    needs WORLD_SIZE > 1) ends here instead, without the interpreter's finalization
    (`trainer.launch.end_rank`)."""
    code = _run(argv)
    launch = sys.modules.get("trainer.launch")  # imported only by a command that trains
    if launch is not None and launch.joined_a_group():
        launch.end_rank(code)
    return code


def _run(argv: list[str] | None) -> int:
    try:
        args = _parse(argv)
    except _ArgumentError as e:  # argparse has printed the usage; exit 2 like argparse, with the JSON object
        wants_json = "--json" in (sys.argv[1:] if argv is None else argv)
        return _fail(argparse.Namespace(json=wants_json), str(e), 2)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "httpcore", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from data.redact import RedactingFormatter, redact

    for handler in logging.getLogger().handlers:  # a URI in a log line or a traceback is shown masked
        handler.setFormatter(
            RedactingFormatter(handler.formatter._fmt if handler.formatter else None, datefmt="%H:%M:%S")
        )
    try:
        # --json: stdout holds the JSON alone, a library's prints (DeepSpeed's) go to stderr; serve-model
        # streams its own
        with contextlib.redirect_stdout(
            sys.stderr if args.json and not getattr(args, "streams_json", 0) else sys.stdout
        ):
            result = args.func(args)
    except (
        GrpoflowUserError
    ) as e:  # ConfigError, DataError, UsageError, MissingPathError, ServiceUnavailable...
        return _fail(args, f"grpoflow {args.command}: error: {e}", 2)
    except KeyboardInterrupt:
        return _fail(args, f"grpoflow {args.command}: error: interrupted", 130)
    except Exception as e:  # noqa: BLE001 - the CLI's last word on any failure, with the traceback in the log
        if _interrupted(e):
            return _fail(args, f"grpoflow {args.command}: error: interrupted", 130)
        if (disk := _storage_error(e)) is not None:  # one line, no traceback: the disk, not the code
            target = disk.filename or getattr(args, "out", None)  # a write() error names no file
            where = f": {target}" if target else ""
            if disk.errno in _NO_SPACE:
                what, remedy = _NO_SPACE[disk.errno]
                return _fail(
                    args,
                    f"grpoflow {args.command}: error: {what} writing{where}; {remedy} and run it again",
                    1,
                )
            return _fail(
                args, f"grpoflow {args.command}: error: cannot write{where}: {_NOT_WRITABLE[disk.errno]}", 2
            )
        logging.getLogger("grpoflow").exception("%s failed", args.command)
        if args.json:
            print(json.dumps({"error": redact(f"{type(e).__name__}: {e}"), "exit_code": 1}))
        return 1
    if args.json and result is not None:  # None: a trainer rank other than 0, or a launcher
        print(redact(json.dumps(result, default=str)))
    return (
        int(result.get("exit_code", 0)) if isinstance(result, dict) else 0
    )  # a command's own verdict, e.g. a failed gate


if __name__ == "__main__":
    sys.exit(main())
