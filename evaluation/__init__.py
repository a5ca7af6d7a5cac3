"""Evaluation: EvalScope runs against a checkpoint or an OpenAI-compatible endpoint, and their scores.

Never imports Prefect, MLflow, `flows` or `tasks`; `tasks/` binds these results to tracking.
"""

from evaluation.evalscope_reports import BenchmarkReport, read_report
from evaluation.evalscope_runner import EvalResult, load_result, run_evalscope

__all__ = ["BenchmarkReport", "EvalResult", "load_result", "read_report", "run_evalscope"]
