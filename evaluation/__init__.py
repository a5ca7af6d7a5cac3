"""Evaluation: EvalScope runs against a checkpoint or an OpenAI-compatible endpoint, and their scores.

`evaluate(model, settings)` is the one entry point (settings: a recipe's `eval` section); `made_with` and
`setting_differences` the one answer to "were these evaluations made with the same settings?".
Never imports Prefect, MLflow, `flows` or `tasks`; `tasks/` binds these results to tracking.
"""

from evaluation.entry_point import check_evaluation, evaluate
from evaluation.eval_inputs import EvalInputError
from evaluation.eval_settings import EvalSettings, made_with, setting_differences, settings_hash
from evaluation.evalscope_reports import BenchmarkReport, read_report
from evaluation.evalscope_runner import EvalResult, load_result, run_evalscope

__all__ = [
    "BenchmarkReport",
    "EvalInputError",
    "EvalResult",
    "EvalSettings",
    "check_evaluation",
    "evaluate",
    "load_result",
    "made_with",
    "read_report",
    "run_evalscope",
    "setting_differences",
    "settings_hash",
]
