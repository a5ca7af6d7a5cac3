"""Optional packages (the `[gpu]` extra: vLLM, LMDeploy, DeepSpeed), imported only when a recipe asks for them.

Asking for one that is not installed raises `MissingExtraError` (an `ImportError`, and a user error: exit 2)
whose message names what needed it and the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from data.errors import GrpoflowUserError

INSTALL_HINTS = {
    "vllm": "pip install '.[gpu]' (or pip install vllm)",
    "lmdeploy": "pip install '.[gpu]' (or pip install lmdeploy)",
    "deepspeed": "pip install '.[gpu]' (or pip install deepspeed)",
}


class MissingExtraError(GrpoflowUserError, ImportError):
    """A GPU engine (or DeepSpeed) was asked for but its package is not installed."""


def import_extra(module: str, what: str) -> ModuleType:
    """Import `module` for `what` (e.g. "the 'vllm' rollout engine"), or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = INSTALL_HINTS.get(module, f"pip install {module}")
        raise MissingExtraError(f"{what} needs the {module!r} package, which is not installed here ({e}). "
                                f"Install the GPU extra: {hint}. It needs a CUDA machine; on CPU use "
                                "rollout.engine: transformers.") from e
