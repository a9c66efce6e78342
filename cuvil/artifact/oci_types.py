"""Small result types of the OCI side: what a push returns, what a referrer listing holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PushResult:
    """One pushed manifest or index. ``ref`` is pinned by digest; ``tag`` is set when tagged."""

    ref: str
    digest: str
    size: int
    media_type: str
    target: str | None = None
    precision: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return self.ref

    def to_json(self) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "digest": self.digest,
            "size": self.size,
            "mediaType": self.media_type,
            "target": self.target,
            "precision": self.precision,
            "tag": self.tag,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PushResult:
        """Back from ``to_json`` (e.g. per-target task results joined by the index task)."""
        return cls(
            data["ref"],
            data["digest"],
            int(data["size"]),
            data.get("mediaType", "application/vnd.oci.image.manifest.v1+json"),
            data.get("target"),
            data.get("precision"),
            data.get("tag"),
        )


@dataclass(frozen=True)
class Referrer:
    """A manifest whose ``subject`` is another one (a verification report, a signature)."""

    digest: str
    artifact_type: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
