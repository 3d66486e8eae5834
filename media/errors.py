"""Typed errors of the media package.

Every one is a `ValueError`: the problem lies in what the client sent (a URL, an image, an option), so the
server answers 400 with the message. Messages name the problem and never the internals behind it (a resolved
address, a path outside the allowed directory, a stack of library errors).
"""


class MediaError(ValueError):
    """Base class of every error the media package raises on purpose."""


class MediaURLError(MediaError):
    """The URL is malformed, uses an unsupported scheme, or is a data URL we cannot read."""


class MediaForbiddenError(MediaError):
    """The URL points somewhere the server must not go: a private address, a host outside the allowlist,
    a file outside the allowed directory."""


class MediaFetchError(MediaError):
    """Fetching failed: connection error, upstream HTTP error, too many redirects, missing file."""


class MediaTimeoutError(MediaFetchError):
    """Connecting or downloading took longer than the configured limit."""


class MediaTooLargeError(MediaError):
    """The media exceeds a byte or pixel limit (including decompression bombs)."""


class MediaDecodeError(MediaError):
    """The bytes are not an image we accept: unknown or disallowed format, truncated or corrupt data."""


class MediaOptionError(MediaError):
    """A media option is invalid: an unknown image mode, a bad background colour, an unknown kwarg."""
