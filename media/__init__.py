"""Media for multimodal requests: fetch (http, data and file URLs) under limits and an SSRF policy, decode off
the event loop, and hash decoded content for prefix-cache keys."""

from media.connector import MediaConnector
from media.egress import EgressPolicy
from media.errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaForbiddenError,
    MediaOptionError,
    MediaTimeoutError,
    MediaTooLargeError,
    MediaURLError,
)
from media.hashing import HashedImage, media_hash
from media.image import ImageMediaIO, encode_image_base64, encode_image_url
from media.limits import MediaLimits

__all__ = [
    "EgressPolicy",
    "HashedImage",
    "ImageMediaIO",
    "MediaConnector",
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaForbiddenError",
    "MediaLimits",
    "MediaOptionError",
    "MediaTimeoutError",
    "MediaTooLargeError",
    "MediaURLError",
    "encode_image_base64",
    "encode_image_url",
    "media_hash",
]
