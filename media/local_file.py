"""`file:` URLs: map one to a path inside the allowed directory, and read it without surprises."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from media.errors import MediaFetchError, MediaForbiddenError, MediaTooLargeError, MediaURLError


def resolve_allowed_root(path: str | os.PathLike[str]) -> Path:
    """The canonical form of --allowed-local-media-path; it must be an existing directory."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"allowed_local_media_path {str(path)!r} is not an existing directory")
    return root.resolve(strict=True)


def resolve_file_url(url: str, allowed_root: Path | None) -> Path:
    """The resolved path a `file:` URL names, refused unless it lies inside allowed_root.

    Symlinks and `..` are resolved before the containment check, so neither can step outside. A path outside
    is refused whether or not it exists, so the answer reveals nothing about files there.
    """
    if allowed_root is None:
        raise MediaForbiddenError("file: URLs are disabled on this server (no allowed local media path is set)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaURLError("file: URLs must name a local path (file:///path), not a remote host")
    if parts.query or parts.fragment:
        raise MediaURLError("file: URLs must not carry a query or fragment")
    raw_path = unquote(parts.path)
    if not raw_path.startswith("/") or "\x00" in raw_path:
        raise MediaURLError("file: URL must name an absolute path")
    resolved = Path(raw_path).resolve(strict=False)
    if not resolved.is_relative_to(allowed_root):
        raise MediaForbiddenError("file: URL points outside the allowed local media path")
    return resolved


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """Read at most max_bytes from a regular file; FIFOs, devices and directories are refused."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer. O_NOFOLLOW: callers pass resolved paths, so a
        # final component that became a symlink since is a race we refuse rather than follow.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MediaFetchError("local media file does not exist") from None
    except OSError as exc:
        raise MediaFetchError(f"cannot open local media file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaFetchError("local media path is not a regular file")
        if info.st_size > max_bytes:
            raise MediaTooLargeError(f"local media file is {info.st_size} bytes, over the limit of {max_bytes}")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # the file grew after fstat
        raise MediaTooLargeError(f"local media file is over the limit of {max_bytes} bytes")
    return data
