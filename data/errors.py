"""The one base class of every error that is the user's to fix, and the errors of dataset preparation.

`GrpoflowUserError` is what the command line turns into exit status 2 with a one-line message: every error
that means "your input (config, data, flag) or a service you named is wrong" derives from it, wherever it is
raised (`ConfigError`, `DataError`, `RewardSpecError`, `PluginError`, `MissingExtraError`, `UsageError`,
`MissingPathError`, `ServiceUnavailable`, ...). It lives here, in the bottom layer, so that every package can
raise one.

Dataset preparation has two: `DataError` for the user, `FieldError` inside an adapter.

An adapter sees one raw record and knows nothing of where it came from, so it raises `FieldError` (which
field, what was expected, what it got). `data.prepare` adds the location (`train.jsonl:17`) and either raises
a `DataError` or counts the record as dropped under `FieldError.reason`.
"""

from __future__ import annotations

import os
import reprlib

SHOWN_CHARACTERS = 80  # the most of a bad value an error message shows


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 4, SHOWN_CHARACTERS, SHOWN_CHARACTERS, SHOWN_CHARACTERS
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 8
    return r


_REPR = _bounded_repr()


PATH_CHARACTERS = 4096  # the most of a path an error message shows (Linux's PATH_MAX)


def short_repr(value: object, limit: int = SHOWN_CHARACTERS) -> str:
    """`repr(value)` cut to `limit` characters, in time and memory bounded by the cut, not by the value: an
    error message shows what was given without printing (or building) a huge value whole."""
    try:
        shown = _REPR.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        shown = f"<{type(value).__name__} too long to show>"
    return shown if len(shown) <= limit else shown[:limit] + "..."


def shown_path(value: object) -> str:
    """A path or URI as given, whole up to `PATH_CHARACTERS` (an OS path's own limit): an error names a file
    the user can find; anything longer, or not a path, is cut as `short_repr` cuts it."""
    if isinstance(value, (str, os.PathLike)) and len(text := os.fspath(value)) <= PATH_CHARACTERS:
        return repr(text)
    return short_repr(value)


class GrpoflowUserError(Exception):
    """Bad input or an unusable service named by the user: exit status 2, one line naming file, field or
    URL."""


class UsageError(GrpoflowUserError, ValueError):
    """Bad input from the user (a flag, an output path, a model reference) that no narrower class names."""


class MissingPathError(GrpoflowUserError, FileNotFoundError):
    """A path the user named (a checkpoint, a dataset, a work dir, a manifest) is not there or not what was
    expected; the message names the path and what it should have been. Still a `FileNotFoundError` for callers
    that catch that."""


class ServiceUnavailable(GrpoflowUserError):
    """A service the command needs (MLflow, Prefect, an evaluation endpoint) did not answer within its
    timeout; the message names it (credentials masked), what was tried, and the setting that bounds the
    wait."""


class DataError(GrpoflowUserError, ValueError):
    """Bad input to dataset preparation; the message names the source, row or field and what was expected."""


class FieldError(ValueError):
    """One raw record does not fit its task adapter."""

    def __init__(self, field: str, expected: str, got: object = None, *, reason: str | None = None):
        self.field = field
        self.expected = expected
        self.got = got
        if reason is None:
            reason = f"missing field '{field}'" if got is None else f"invalid field '{field}'"
        self.reason = reason  # the drop-count key in the manifest: short and the same for every such row
        message = f"field '{field}': expected {expected}"
        if got is not None:
            message += f", got {short_repr(got)}"
        super().__init__(message)
