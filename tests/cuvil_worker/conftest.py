"""Fixtures for the worker tests: a real Redis (and, for the pipeline tests, a real registry)."""

from tests.fixtures.redis import redis_server, redis_session

__all__ = ["redis_server", "redis_session"]
