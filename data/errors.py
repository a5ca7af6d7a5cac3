"""The two errors of dataset preparation: `DataError` for the user, `FieldError` inside an adapter.

An adapter sees one raw record and knows nothing of where it came from, so it raises `FieldError` (which field,
what was expected, what it got). `data.prepare` adds the location (`train.jsonl:17`) and either raises a
`DataError` or counts the record as dropped under `FieldError.reason`.
"""

from __future__ import annotations


class DataError(ValueError):
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
            shown = repr(got)
            message += f", got {shown[:80] + '...' if len(shown) > 80 else shown}"
        super().__init__(message)
