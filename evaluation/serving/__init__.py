"""Serving a checkpoint behind an OpenAI-compatible endpoint: inference, not scoring.

- `launcher`: `serve()` in this process, `served_model()` as a child for a `with` block, the CLI flags.
- `guards`: the per-request limits, the listening address and the API key (`ServingInputError`).
- `app`: the FastAPI routes of the transformers server; `scheduler`: token slices shared fairly between
  requests; `server`: loading the checkpoint and running it all under uvicorn.

Layers: like the rest of `evaluation/` it never imports Prefect, MLflow, `flows` or `tasks`; unlike it, it
may use the trainer's inference pieces (`trainer.model_loading` with `trainer.recipe.ModelConfig`,
`trainer.rollout`, `trainer.prompts`), so a served checkpoint generates exactly as the trainer's engine does.
"""

from evaluation.serving.guards import ServerLimits, ServingInputError
from evaluation.serving.launcher import (
    ServedModel,
    add_server_arguments,
    get_json,
    serve,
    serve_from_args,
    served_model,
)

__all__ = [
    "ServedModel",
    "ServerLimits",
    "ServingInputError",
    "add_server_arguments",
    "get_json",
    "serve",
    "serve_from_args",
    "served_model",
]
