"""How to talk to registries: credentials (docker config file), TLS trust, plain HTTP, timeouts.

A docker ``config.json`` is what ``docker login`` writes and what a Kubernetes
``kubernetes.io/dockerconfigjson`` secret mounts (key ``.dockerconfigjson``): ``{"auths": {host:
{"auth": base64(user:password)} | {"username", "password"} | {"identitytoken"}}}``.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cuvil.artifact.reference import Reference

ENV_REGISTRY_CONFIG = "CUVIL_REGISTRY_CONFIG"
ENV_CA_BUNDLE = "CUVIL_REGISTRY_CA_BUNDLE"
ENV_PLAIN_HTTP = "CUVIL_REGISTRY_PLAIN_HTTP"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class RegistryConfig:
    """``plain_http``: None speaks HTTP to loopback registries only, True to all, False to none."""

    docker_config: Path | None = None
    ca_bundle: Path | None = None
    plain_http: bool | None = None
    timeout_s: float = 30.0
    attempts: int = 2

    @classmethod
    def from_env(cls) -> RegistryConfig:
        config = os.environ.get(ENV_REGISTRY_CONFIG)
        if not config:
            default = Path(os.environ.get("DOCKER_CONFIG", "~/.docker")).expanduser()
            config = str(default / "config.json")
        ca_bundle = os.environ.get(ENV_CA_BUNDLE)
        plain = os.environ.get(ENV_PLAIN_HTTP, "").lower()
        return cls(
            docker_config=Path(config),
            ca_bundle=Path(ca_bundle) if ca_bundle else None,
            plain_http=True if plain in ("1", "true", "yes") else None,
        )

    @classmethod
    def coerce(cls, value: RegistryConfig | str | Path | None) -> RegistryConfig:
        if value is None:
            return cls.from_env()
        if isinstance(value, RegistryConfig):
            return value
        return cls(docker_config=Path(value))

    def uses_plain_http(self, reference: Reference) -> bool:
        if self.plain_http is not None:
            return self.plain_http
        return reference.is_loopback

    def credentials_for(self, registry: str) -> Credentials | None:
        """The docker config's entry for ``registry`` (also tried with and without a scheme)."""
        if self.docker_config is None or not self.docker_config.is_file():
            return None
        try:
            auths = json.loads(self.docker_config.read_text()).get("auths", {})
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read docker config {self.docker_config}: {error}") from None
        aliases = _host_aliases(registry)
        for key, entry in auths.items():
            host = key.removeprefix("https://").removeprefix("http://").rstrip("/")
            host = host.removesuffix("/v1").removesuffix("/v2")
            if host in aliases and isinstance(entry, dict):
                return _entry_credentials(entry, key)
        return None


def _host_aliases(registry: str) -> set[str]:
    aliases = {registry}
    if "localhost" in registry:
        aliases.add(registry.replace("localhost", "127.0.0.1"))
    if "127.0.0.1" in registry:
        aliases.add(registry.replace("127.0.0.1", "localhost"))
    return aliases


def _entry_credentials(entry: dict[str, str], key: str) -> Credentials | None:
    if entry.get("auth"):
        try:
            decoded = base64.b64decode(entry["auth"]).decode()
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"docker config entry {key!r}: 'auth' is not base64") from None
        username, sep, password = decoded.partition(":")
        if not sep:
            raise ValueError(f"docker config entry {key!r}: 'auth' is not user:password")
        return Credentials(username, password)
    if entry.get("username") and entry.get("password"):
        return Credentials(entry["username"], entry["password"])
    if entry.get("identitytoken"):
        return Credentials("<token>", entry["identitytoken"])
    return None


def write_docker_config(path: str | Path, registry: str, username: str, password: str) -> Path:
    """Write (or update) a docker config with credentials for ``registry``; mode 0600."""
    path = Path(path)
    data: dict[str, dict[str, dict[str, str]]] = {"auths": {}}
    if path.is_file():
        data = json.loads(path.read_text())
        data.setdefault("auths", {})
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    data["auths"][registry] = {"auth": token}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    path.chmod(0o600)
    return path
