"""Loading user code that a recipe names: `package.module:attribute` or `path/to/file.py:attribute`.

Used for reward functions and training callbacks. This loads code the user chose to run, never text a
model wrote.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from data.errors import GrpoflowUserError


class PluginError(GrpoflowUserError, ValueError):
    """A plug-in reference cannot be resolved; the message names the module or file and the attribute."""


def load_plugin(spec: str, base_dir: str | Path | None = None, what: str = "plug-in"):
    """The callable named by `spec`; relative file paths are resolved against `base_dir` (else the cwd)."""
    target, _, attribute = spec.rpartition(":")  # rpartition: a Windows path keeps its drive letter
    if not target or not attribute:
        raise PluginError(f"{what} {spec!r} must look like 'module:function' or 'file.py:function'")
    if target.endswith(".py"):
        module, where = _load_file(target, base_dir, spec, what)
    else:
        module, where = _import_module(target, spec, what), f"module {target!r}"
    obj = getattr(module, attribute, None)
    if obj is None:
        raise PluginError(f"{what} {spec!r}: {where} has no attribute {attribute!r}")
    if not callable(obj):
        raise PluginError(f"{what} {spec!r}: {attribute!r} in {where} is not callable")
    return obj


def _import_module(name: str, spec: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise PluginError(
            f"{what} {spec!r}: cannot import module {name!r} ({type(error).__name__}: {error})"
        ) from error


def _load_file(target: str, base_dir: str | Path | None, spec: str, what: str) -> tuple[ModuleType, str]:
    path = Path(target).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.resolve()
    where = f"file {str(path)!r}"
    if not path.is_file():
        raise PluginError(f"{what} {spec!r}: {where} does not exist")
    # One module per file path, registered in sys.modules so that loading it twice gives the same functions
    # and objects defined in it can be pickled (dataloader workers, multiprocessing).
    module_name = "grpoflow_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name], where
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"{what} {spec!r}: {where} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise PluginError(
            f"{what} {spec!r}: {where} failed to load ({type(error).__name__}: {error})"
        ) from error
    return module, where
