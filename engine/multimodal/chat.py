"""OpenAI chat messages with image parts -> messages a chat template renders, plus the image URLs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ChatImages:
    messages: list[dict[str, Any]]  # image_url parts replaced by {"type": "image"} (HF's convention)
    image_urls: list[str]  # in the order their placeholders appear


def split_image_parts(messages: Sequence[Mapping[str, Any]]) -> ChatImages:
    """Pull the URL out of every `image_url` part; text parts stay, anything else is refused."""
    out: list[dict[str, Any]] = []
    urls: list[str] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                urls.append(_image_url(part, i))
                parts.append({"type": "image"})
            elif kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}]: text content parts need a string 'text'")
                parts.append(dict(part))
            else:
                raise InvalidRequestError(f"messages[{i}]: content part type {kind!r} is not supported")
        out.append({**message, "content": parts})
    return ChatImages(out, urls)


def _image_url(part: Mapping[str, Any], index: int) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value  # some clients send the URL itself
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"messages[{index}]: image_url parts need an 'image_url' with a string 'url'")
    return url
