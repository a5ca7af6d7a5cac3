"""Masking credentials in URIs before they are shown or stored: the one place that knows what a secret looks
like.

A URI may carry a secret in its userinfo (`postgresql://user:PASS@host/db`, `https://TOKEN@host/v1`) or in a
query parameter (`?api_key=...`, `?sig=...`). `mask_uri` replaces those parts with `***` and leaves the rest
readable (scheme, user name, host, port, path, the other parameters); `redact` does the same for every URI in
free text (an error message, a log line, a traceback). Masking is idempotent and never raises: something that
is not a URI comes back unchanged.

Used wherever a URI leaves the process: CLI output (`--json` included), logs, MLflow params and tags,
`report.json`, EvalScope's configuration. The real values are only ever used to connect.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

MASK = "***"
# Query parameters that carry credentials, compared lower-case with '-' read as '_'.
SECRET_PARAMS = frozenset(
    {
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "auth",
        "auth_token",
        "api_key",
        "apikey",
        "key",
        "password",
        "passwd",
        "pwd",
        "secret",
        "client_secret",
        "sig",
        "signature",
        "x_amz_signature",
        "x_amz_security_token",
        "x_amz_credential",
        "x_goog_signature",
        "x_goog_credential",
        "sas",
        "code",
    }
)
_SECRET_SUFFIXES = ("_token", "_secret", "_key", "_password", "_signature")
# A URI in free text: scheme://..., up to whitespace, a quote or a bracket that closes it.
# scheme://user:password@ where the password holds characters that end a netloc for urlsplit.
_RAW_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)([^:/?#@\s]*):([^@\s]*)@")
_URI_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def is_secret_param(name: str) -> bool:
    key = name.strip().lower().replace("-", "_")
    return key in SECRET_PARAMS or key.endswith(_SECRET_SUFFIXES)


def has_credentials(uri: str) -> bool:
    """Whether `uri` carries userinfo or a secret query parameter (what `mask_uri` would hide)."""
    return mask_uri(uri) != uri


def mask_uri(uri: str) -> str:
    """`uri` with its userinfo secret and secret query values replaced by `***`.

    `scheme://user:pass@host` keeps the user name (`user:***@host`); a lone userinfo is usually a token
    (`https://TOKEN@host`) and is masked whole (`***@host`).
    """
    if not isinstance(uri, str) or "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:  # e.g. an invalid IPv6 host: mask what looks like userinfo by hand
        return re.sub(r"(://)[^/@\s]*@", rf"\g<1>{MASK}@", uri)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep and user else f"{MASK}@{host}"
    elif _RAW_PASSWORD.match(uri):  # a password with '/', '?' or '#' in it, as SQLAlchemy accepts unquoted
        return mask_uri(_RAW_PASSWORD.sub(rf"\g<1>\g<2>:{MASK}@", uri, count=1))
    query = _mask_query(parts.query)
    fragment = _mask_query(parts.fragment) if "=" in parts.fragment else parts.fragment
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return uri  # nothing secret: keep the exact text (urlunsplit would normalise it)
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _mask_query(query: str) -> str:
    if not query:
        return query
    out = []
    for item in query.split("&"):
        name, sep, value = item.partition("=")
        out.append(f"{name}={MASK}" if sep and value and value != MASK and is_secret_param(name) else item)
    return "&".join(out)


def redact(text: str) -> str:
    """`text` with every URI in it masked (see `mask_uri`)."""
    if not isinstance(text, str) or "://" not in text:
        return text

    def mask(m: re.Match) -> str:
        uri = m.group(0)
        body = uri.rstrip(").,;:]}")  # punctuation that closes the sentence, not the URI
        return mask_uri(body) + uri[len(body) :]

    return _URI_IN_TEXT.sub(mask, text)


def strip_credentials(uri: str) -> tuple[str, str | None, dict[str, str]]:
    """(`uri` without userinfo and query, `user:password` or None, the query parameters).

    For a client that must send the credentials itself (as an Authorization header and query parameters)
    while only the bare URI is ever shown or written down.
    """
    parts = urlsplit(uri)
    userinfo = None
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
    bare = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return bare, userinfo, dict(parse_qsl(parts.query, keep_blank_values=True))


class RedactingFormatter(logging.Formatter):
    """A log formatter whose output (message and traceback) has every URI masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
