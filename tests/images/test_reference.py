"""The image reference grammar that guards the Docker engine's API (its URLs carry a reference unescaped)."""

from __future__ import annotations

import pytest

from bunshin_async._exceptions import ImageError
from bunshin_async._images._docker import check_reference, is_reference

pytestmark = pytest.mark.unit

GOOD = [
    "debian",
    "debian:bookworm",
    "debian-bookworm",
    "bunshin-test/bookworm:0123abcd",
    "localhost:5000/team/app:v1.2_rc-3",
    "docker.io/library/python:3.11-slim",
    "a__b/c---d/e.f",
    "app@sha256:" + "0" * 64,
    "app:1@sha256:" + "a" * 64,
    "sha256:0123456789ab",  # an imported image's digest prefix: a name and a tag to the grammar
]
BAD = [
    "",
    "../containers/json",
    "a/../b",
    "images/x/json?all=1",
    "a#b",
    "a b",
    "Upper",
    "a:b:c",
    "/a",
    "a/",
    "a..b",
    "a:" + "t" * 129,
    "a@sha256:short",
    "x" * 513,
]


@pytest.mark.parametrize("ref", GOOD)
def test_references(ref: str) -> None:
    assert is_reference(ref)
    check_reference(ref)


@pytest.mark.parametrize("ref", BAD)
def test_not_references(ref: str) -> None:
    assert not is_reference(ref)
    with pytest.raises(ImageError, match="is not an image reference"):
        check_reference(ref)
