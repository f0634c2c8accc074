"""What counts as a pinned image reference."""

from __future__ import annotations

import re

# name[:tag][@sha256:digest]; a pinned reference has a digest, or a tag that names an exact version
# (digits and dots, optionally a v prefix and a -suffix such as -slim-bookworm).
_REF = re.compile(
    r"^(?P<name>[a-z0-9][a-z0-9._/-]*(?::[0-9]+/[a-z0-9._/-]+)?)(?::(?P<tag>[\w][\w.-]*))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_EXACT = re.compile(r"^v?[0-9]+\.[0-9]+\.[0-9]+(?:[-+.][\w.-]+)?$")


def unpinned_reason(ref: str) -> str | None:
    """None when ``ref`` is pinned, else why not."""
    match = _REF.match(ref)
    if match is None:
        return f"{ref!r} is not an image reference"
    if match.group("digest"):
        return None
    tag = match.group("tag")
    if tag is None:
        return f"{ref!r} has no tag (means :latest)"
    if not _EXACT.match(tag):
        return f"{ref!r}: tag {tag!r} is not an exact major.minor.patch version"
    return None
