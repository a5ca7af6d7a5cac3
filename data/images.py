"""Image references in dataset rows: what a row may give, what a prepared row keeps, and reading the bytes back.

A source record's image may be
- a local path (relative to the source file's directory, or absolute), or a `file://` URL;
- an `http(s)://` URL (fetched with a timeout, at preparation to check and hash it, and again when used);
- the image itself: raw bytes, `{"bytes": ...}` (the datasets `Image` feature as stored in Parquet), a
  `data:image/...;base64,` URI or bare base64 text.

A prepared row keeps one string per image: an absolute path, the URL, or a `data:` URI for an embedded image,
so every prepared row stays one JSON line. Each image is opened and decoded at preparation: a missing or
unreadable image is a `FieldError` naming the field, the path and what went wrong, never a crash in training.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from data.errors import FieldError

URL_TIMEOUT_S = 30.0
_SCHEMES = ("http://", "https://")


def image_refs(value: object, name: str, base_dir: Path | None) -> list[str]:
    """The prepared references of a record's image field `name` (one image or a list of them), each checked."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise FieldError(name, "at least one image", reason="empty field 'images'")
    return [_one_ref(item, name, base_dir) for item in items]


def _one_ref(value: object, name: str, base_dir: Path | None) -> str:
    if isinstance(value, dict):  # the datasets Image feature: {"bytes": b"..." or None, "path": "..."}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        ref = "data:image;base64," + base64.b64encode(bytes(value)).decode("ascii")
    elif not isinstance(value, str) or not value.strip():
        raise FieldError(name, "an image path, URL, bytes or base64 text", type(value).__name__)
    else:
        ref = _text_ref(value.strip(), name, base_dir)
    check_image(ref, name)
    return ref


def _text_ref(value: str, name: str, base_dir: Path | None) -> str:
    if value.startswith(_SCHEMES) or value.startswith("data:"):
        return value
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif _looks_like_base64(value):
        return "data:image;base64," + value
    path = Path(value).expanduser()
    if not path.is_absolute():
        if base_dir is None:
            raise FieldError(name, "an absolute image path or a URL (a hub record has no directory to resolve a "
                                   "relative path in)", value)
        path = base_dir / path
    if not path.is_file():
        # the path in full in the message (a value shown as `got` is cut at 80 characters)
        raise FieldError(name, f"an existing image file; not found: {path}", reason="image not found")
    return str(path.resolve())


def _looks_like_base64(value: str) -> bool:
    # a path has a dot or a slash within its first characters; an encoded image is long and has neither
    return len(value) > 256 and "." not in value[:64] and "/" not in value[:8]


def image_bytes(ref: str, timeout_s: float = URL_TIMEOUT_S) -> bytes:
    """The encoded bytes (PNG, JPEG...) behind a prepared reference."""
    if ref.startswith("data:"):
        try:
            return base64.b64decode(ref.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error) as e:
            raise ValueError(f"not valid base64 image data ({e})") from None
    if ref.startswith(_SCHEMES):
        with urllib.request.urlopen(ref, timeout=timeout_s) as response:  # noqa: S310 (http(s) only, checked above)
            return response.read()
    return Path(ref).read_bytes()


def load_image(ref: str, timeout_s: float = URL_TIMEOUT_S):
    """The image behind a prepared reference, decoded, as an RGB `PIL.Image`."""
    from PIL import Image

    image = Image.open(io.BytesIO(image_bytes(ref, timeout_s)))
    image.load()
    return image.convert("RGB")


def check_image(ref: str, name: str) -> None:
    """FieldError (reason 'unreadable image') unless `ref` decodes as an image."""
    try:
        load_image(ref)
    except Exception as e:  # PIL raises several unrelated types for bad files
        shown = ref if not ref.startswith("data:") else f"{ref[:40]}... ({len(ref)} characters)"
        detail = str(e).split(" at 0x")[0] if str(e) else type(e).__name__  # PIL's text names an object address
        raise FieldError(name, f"a readable image; {shown}: {detail[:120]}", reason="unreadable image") from None


def images_digest(refs: Iterable[str]) -> dict | None:
    """A hash over the bytes of every distinct image `refs` name (paths and URLs point outside a prepared
    directory, so its files' hash alone would miss a changed image); None when there is none."""
    distinct = sorted(set(refs))
    if not distinct:
        return None
    h = hashlib.sha256()
    for ref in distinct:
        key = ref if not ref.startswith("data:") else "data:"  # an embedded image is its own bytes
        h.update(key.encode() + b"\0" + hashlib.sha256(image_bytes(ref)).hexdigest().encode() + b"\n")
    return {"files": len(distinct), "sha256": h.hexdigest()}


__all__ = ["URL_TIMEOUT_S", "check_image", "image_bytes", "image_refs", "images_digest", "load_image"]
