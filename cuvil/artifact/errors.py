"""Errors of artifacts: ``ArtifactError`` for their content, and those of the OCI side, shared by
registry, layout, cache and resolver.

Every OCI error is an ``OSError`` (so the CLI prints it as one line) and says whether retrying
the same call later can help (``retryable``): the worker retries those with backoff, the sidecar
keeps polling, everything else fails at once.
"""

from __future__ import annotations


class ArtifactError(ValueError):
    """The artifact is malformed, incomplete or fails a digest check."""


class RegistryError(OSError):
    """A registry, layout or cache operation failed."""

    retryable = False


class RegistryUnavailableError(RegistryError, ConnectionError):
    """The registry could not be reached or answered 5xx: retry later, the same call may succeed."""

    retryable = True


class AuthenticationError(RegistryError):
    """The registry refused the credentials (or none were configured and it wants some)."""


class NotFoundError(RegistryError, LookupError):
    """No such repository, tag, manifest or blob."""


class DigestMismatchError(RegistryError):
    """Content does not match the digest it was asked for: refused, nothing corrupt is kept."""


class NoMatchingTargetError(RegistryError, LookupError):
    """An index offers no entry that this machine can run; the message lists what it offers."""
