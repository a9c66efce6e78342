"""Cuvil artifacts: files on disk, and (later) OCI push/pull."""
