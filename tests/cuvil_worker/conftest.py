"""Fixtures for the worker tests: a real Redis and a real registry (both session-scoped)."""

from tests.fixtures.redis import redis_server, redis_session
from tests.fixtures.registry import registry

__all__ = ["redis_server", "redis_session", "registry"]
