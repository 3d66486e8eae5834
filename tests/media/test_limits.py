"""MediaLimits: defaults and validation."""

from __future__ import annotations

import dataclasses

import pytest

from media import MediaLimits


def test_defaults():
    limits = MediaLimits()
    assert (limits.max_bytes, limits.max_pixels, limits.max_redirects) == (20 * 1024 * 1024, 50_000_000, 3)
    assert 0 < limits.connect_timeout <= limits.total_timeout


@pytest.mark.parametrize(
    "field",
    [{"max_bytes": 0}, {"max_pixels": 0}, {"connect_timeout": 0}, {"total_timeout": -1.0}, {"max_redirects": -1}],
    ids=lambda f: next(iter(f)),
)
def test_out_of_range_values_are_refused(field):
    with pytest.raises(ValueError, match=next(iter(field))):
        MediaLimits(**field)


def test_limits_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MediaLimits().max_bytes = 1
