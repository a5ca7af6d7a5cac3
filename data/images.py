"""Image references in dataset rows: what a row may give, what a prepared row keeps, and reading the bytes
back.

A source record's image may be
- a local path (relative to the source file's directory, or absolute), or a `file://` URL;
- an `http(s)://` URL (fetched at preparation to check and hash it, and again when used);
- the image itself: raw bytes, `{"bytes": ...}` (the datasets `Image` feature as stored in Parquet), a
  `data:image/...;base64,` URI or bare base64 text.

A prepared row keeps one string per image: an absolute path, the URL, or a `data:` URI for an embedded image,
so every prepared row stays one JSON line. Each image is opened and decoded at preparation: a missing or
unreadable image is a `FieldError` naming the field, the path and what went wrong, never a crash in training.

Every image is read within limits, wherever it is read (prep, training, plots: `image_bytes` and `load_image`
are the only readers), so that one bad reference cannot hold a run or its memory:
- a URL has `URL_TIMEOUT_S` for the whole request (connecting, headers and body), not for each read: a server
  that sends a byte every few seconds is cut off at the deadline;
- at most `MAX_IMAGE_BYTES` of encoded image are read, from a URL, a file or a `data:` URI: a larger declared
  `Content-Length` is refused before the body is read, and a body is read no further than one byte past it;
- an image is decoded only if its declared size is at most `MAX_IMAGE_PIXELS` (read from its header before
  any pixel is): a small PNG can declare 12000 x 12000 pixels, half a gigabyte once decoded.
Each refusal is an `ImageRefused` naming the limit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import socket
import threading
import urllib.request
import warnings
from collections.abc import Iterable
from pathlib import Path

from data.errors import FieldError
from data.redact import mask_uri

URL_TIMEOUT_S = 30.0  # the deadline of one whole image request
MAX_IMAGE_BYTES = 64 << 20  # an encoded image (PNG, JPEG...); a 25-megapixel PNG is rarely larger
# width x height: 5000 x 5000 (Qwen2.5-VL's processor scales anything past 12.8M pixels down anyway)
MAX_IMAGE_PIXELS = 25_000_000
_SCHEMES = ("http://", "https://")
_CHUNK = 1 << 16


class ImageRefused(ValueError):
    """An image past one of this module's limits; the message names the limit, `reason` is the drop-count
    key."""

    def __init__(self, message: str, reason: str = "image too large"):
        super().__init__(message)
        self.reason = reason


def image_refs(value: object, name: str, base_dir: Path | None) -> list[str]:
    """The prepared references of a record's image field `name` (one image or a list of them), each
    checked."""
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
        value = value[len("file://") :]
    elif _looks_like_base64(value):
        return "data:image;base64," + value
    path = Path(value).expanduser()
    if not path.is_absolute():
        if base_dir is None:
            raise FieldError(
                name,
                "an absolute image path or a URL (a hub record has no directory to resolve a "
                "relative path in)",
                value,
            )
        path = base_dir / path
    if not path.is_file():
        # the path in full in the message (a value shown as `got` is cut at 80 characters)
        raise FieldError(name, f"an existing image file; not found: {path}", reason="image not found")
    return str(path.resolve())


def _looks_like_base64(value: str) -> bool:
    # a path has a dot or a slash within its first characters; an encoded image is long and has neither
    return len(value) > 256 and "." not in value[:64] and "/" not in value[:8]


def image_bytes(ref: str, timeout_s: float | None = None) -> bytes:
    """The encoded bytes (PNG, JPEG...) behind a prepared reference, at most `MAX_IMAGE_BYTES`; a URL within
    `timeout_s` (default `URL_TIMEOUT_S`) for the whole request."""
    try:
        return _read(ref, URL_TIMEOUT_S if timeout_s is None else timeout_s)
    except ImageRefused as e:
        raise ImageRefused(f"{_shown(ref)}: {e}", e.reason) from None


def _read(ref: str, timeout_s: float) -> bytes:
    if ref.startswith("data:"):
        encoded = ref.split(",", 1)[1] if "," in ref else ""
        if len(encoded) // 4 * 3 > MAX_IMAGE_BYTES:
            raise _too_many_bytes(f"its base64 text stands for {len(encoded) // 4 * 3:,} bytes")
        try:
            return base64.b64decode(encoded, validate=True)
        except binascii.Error as e:
            raise ValueError(f"not valid base64 image data ({e})") from None
    if ref.startswith(_SCHEMES):
        return _fetch(ref, timeout_s)
    with open(ref, "rb") as f:
        data = f.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES:
        raise _too_many_bytes("the file is larger")
    return data


def load_image(ref: str, timeout_s: float | None = None):
    """The image behind a prepared reference, decoded, as an RGB `PIL.Image`; refused (`ImageRefused`) past
    `MAX_IMAGE_BYTES` or `MAX_IMAGE_PIXELS`, before its pixels are decoded."""
    from PIL import Image

    with warnings.catch_warnings():  # PIL warns past its own (larger) pixel limit: ours is checked below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(image_bytes(ref, timeout_s)))
        except Image.DecompressionBombError:  # past twice PIL's limit: refused by PIL before ours is seen
            detail = _too_many_pixels("more than twice PIL's own limit")
            raise ImageRefused(f"{_shown(ref)}: {detail}") from None
    width, height = image.size  # from the header: nothing is decoded yet
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageRefused(f"{_shown(ref)}: {_too_many_pixels(f'it is {width} x {height}')}")
    image.load()
    return image.convert("RGB")


def _too_many_bytes(detail: str) -> ImageRefused:
    return ImageRefused(
        f"larger than the {MAX_IMAGE_BYTES:,}-byte limit of an image (data.images.MAX_IMAGE_BYTES): {detail}"
    )


def _too_many_pixels(detail: str) -> str:
    return (
        f"declares more pixels than the {MAX_IMAGE_PIXELS:,}-pixel limit of an image "
        f"(data.images.MAX_IMAGE_PIXELS): {detail}"
    )


class _Deadline:
    """The sockets one request opens (a redirect opens another), shut down when its deadline passes: a socket
    timeout bounds each read, and a server that sends a byte just before each one would never time out."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.sockets: list[socket.socket] = []
        self.expired = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self.sockets)
        for sock in sockets:
            _shut(sock)

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self.sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def error(self) -> ImageRefused:
        return ImageRefused(
            f"no complete answer within {self.seconds:g} s, the deadline of a whole image "
            "request (data.images.URL_TIMEOUT_S)",
            reason="image timed out",
        )


def _shut(sock: socket.socket) -> None:
    try:
        # wakes a read blocked in another thread (close() would not); the plain socket's method, so that
        # a TLS socket's state is left to the thread reading it
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _tracking(handler: type) -> type:
    """`handler` (urllib's HTTP or HTTPS handler) registering the socket of each connection it opens with a
    `_Deadline` (urllib detaches a connection's socket once the headers are in: the response reads it)."""

    class Tracking(handler):
        def __init__(self, deadline: _Deadline):
            super().__init__()
            self.deadline = deadline

        def do_open(self, http_class, req, **kwargs):
            deadline = self.deadline

            def connection(host, **options):
                made = http_class(host, **options)
                connect = made.connect

                def connect_tracked():
                    connect()
                    deadline.track(made.sock)

                made.connect = connect_tracked
                return made

            return super().do_open(connection, req, **kwargs)

    return Tracking


_HTTP, _HTTPS = _tracking(urllib.request.HTTPHandler), _tracking(urllib.request.HTTPSHandler)


def _fetch(url: str, timeout_s: float) -> bytes:
    with _Deadline(timeout_s) as deadline:
        opener = urllib.request.build_opener(_HTTP(deadline), _HTTPS(deadline))
        try:
            with opener.open(url, timeout=timeout_s) as response:
                declared = response.headers.get("Content-Length", "")
                if declared.strip().isdigit() and int(declared) > MAX_IMAGE_BYTES:
                    raise _too_many_bytes(f"the server declares {int(declared):,} bytes")
                data = bytearray()
                while chunk := response.read(min(_CHUNK, MAX_IMAGE_BYTES + 1 - len(data))):
                    data += chunk
                    if len(data) > MAX_IMAGE_BYTES:
                        raise _too_many_bytes("the server sent more")
        except ImageRefused:
            raise
        except Exception:
            if deadline.expired:  # the shutdown surfaces as whatever the interrupted read raises
                raise deadline.error() from None
            raise
        if deadline.expired:  # a shut-down socket can also read as a clean end of the body
            raise deadline.error()
    return bytes(data)


def check_image(ref: str, name: str) -> None:
    """FieldError unless `ref` decodes as an image within limits (reason 'unreadable image', or the
    `ImageRefused` reason: 'image too large', 'image timed out')."""
    try:
        load_image(ref)
    except ImageRefused as e:  # our own text, naming the image and the limit: shown whole
        raise FieldError(name, f"an image within limits; {e}", reason=e.reason) from None
    except Exception as e:  # PIL raises several unrelated types for bad files
        detail = (
            str(e).split(" at 0x")[0] if str(e) else type(e).__name__
        )  # PIL's text names an object address
        raise FieldError(
            name, f"a readable image; {_shown(ref)}: {detail[:120]}", reason="unreadable image"
        ) from None


def _shown(ref: str) -> str:
    if ref.startswith("data:"):
        return f"{ref[:40]}... ({len(ref):,} characters)"
    return mask_uri(ref)


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


__all__ = [
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "URL_TIMEOUT_S",
    "ImageRefused",
    "check_image",
    "image_bytes",
    "image_refs",
    "images_digest",
    "load_image",
]
