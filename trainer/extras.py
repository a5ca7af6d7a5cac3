"""Optional packages (the `vllm`, `lmdeploy` and `deepspeed` extras), imported only when a recipe asks for
them.

Asking for one that is not installed raises `MissingExtraError` (an `ImportError`, and a user error: exit 2)
whose message names what needed it and the command that installs it. Each engine is its own extra: vLLM and
LMDeploy pin torch versions that do not overlap (pyproject.toml says which), so they go in separate
environments. There is no all-in-one `gpu` extra (pyproject.toml says why).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from data.errors import GrpoflowUserError

INSTALL_HINTS = {
    "vllm": "pip install '.[vllm]' (or pip install vllm)",
    "lmdeploy": "pip install '.[lmdeploy]' in an environment without vLLM (or pip install lmdeploy)",
    "deepspeed": "pip install --no-build-isolation '.[deepspeed]' (or pip install deepspeed)",
}
CPU_NOTES = {
    "vllm": " On CPU use vLLM's CPU build (`make install-vllm`) or rollout.engine: transformers.",
    "lmdeploy": " LMDeploy has no CPU backend: on CPU use rollout.engine: transformers.",
}


class MissingExtraError(GrpoflowUserError, ImportError):
    """A GPU engine (or DeepSpeed) was asked for but its package is not installed."""


def import_extra(module: str, what: str) -> ModuleType:
    """Import `module` for `what` (e.g. "the 'vllm' rollout engine"), or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(module, what, str(e)) from e


def require_extra(module: str, what: str) -> None:
    """`import_extra`'s error, without importing `module`: for a process that starts others which import it
    (the trainer, before its rollout workers), so that a missing install stops the run before they start."""
    if importlib.util.find_spec(module) is None:
        raise missing_extra(module, what, f"No module named {module!r}")


def missing_extra(module: str, what: str, reason: str) -> MissingExtraError:
    hint = INSTALL_HINTS.get(module, f"pip install {module}")
    return MissingExtraError(
        f"{what} needs the {module!r} package, which is not installed here ({reason}). "
        f"Install its extra: {hint}.{CPU_NOTES.get(module, '')}"
    )
