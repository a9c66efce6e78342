"""A repository of an OCI registry, spoken to through oras-py (the only module importing oras).

oras-py provides the session, the auth backends (basic for htpasswd registries, token for
bearer-token ones) and the request-with-authentication loop. Three of its habits are corrected here:
- its ``do_request`` retries 5 times with sleeps of 3 to 83 s: a stopped registry would hang a
  call for two minutes; we retry ``RegistryConfig.attempts`` times with short pauses and then raise
  ``RegistryUnavailableError`` (retryable) saying so;
- ``login()`` never checks the password: ``_connect`` makes a real request to ``/v2/`` with the
  credentials, so wrong ones fail at once with ``AuthenticationError``;
- it can't set ``artifactType`` or push an index: manifests go up as our own canonical bytes, and
  the digest the registry reports is checked against ours.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import oras.auth
import oras.provider
import requests

from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import (
    AuthenticationError,
    DigestMismatchError,
    NotFoundError,
    RegistryError,
    RegistryUnavailableError,
)
from cuvil.artifact.manifests import Blob, sha256_digest
from cuvil.artifact.reference import Reference, is_digest
from cuvil.artifact.registry_config import RegistryConfig

_ACCEPT = ", ".join([mt.OCI_MANIFEST, mt.OCI_INDEX])
_CHUNK = 1 << 20
_RETRY_PAUSE_S = 0.5
# oras' Registry.do_request is wrapped in its long retry loop; this is the bare function.
_BARE_DO_REQUEST = oras.provider.Registry.do_request.__wrapped__


class _TimeoutSession(requests.Session):
    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout_s)
        return super().request(*args, **kwargs)


class _Client(oras.provider.Registry):
    def do_request(self, *args: Any, **kwargs: Any) -> requests.Response:
        response: requests.Response = _BARE_DO_REQUEST(self, *args, **kwargs)
        auth = self.auth
        if response.status_code == 401 and isinstance(auth, oras.auth.TokenAuth) and auth.token:
            # oras reuses a token whose scope may not cover this request (pull -> push): drop it,
            # so that the retry asks the token server for the scope of this challenge.
            auth.token = None
            response = _BARE_DO_REQUEST(self, *args, **kwargs)
        return response


class RegistryStore:
    """One repository (``location.registry``/``location.repository``) of a registry."""

    def __init__(self, location: Reference, config: RegistryConfig) -> None:
        assert location.registry is not None
        self.location = location
        self.config = config
        self.host = location.registry
        self.scheme = "http" if config.uses_plain_http(location) else "https"
        self.base = f"{self.scheme}://{self.host}/v2/{location.repository}"
        self._client: _Client | None = None
        self._headers: dict[str, str] = {}

    # -- connection and authentication ---------------------------------------------------------
    def _tls_verify(self) -> bool | str:
        return str(self.config.ca_bundle) if self.config.ca_bundle else True

    def _connect(self) -> _Client:
        """Probe ``/v2/``; pick basic or token auth from the challenge; verify the credentials."""
        if self._client is not None:
            return self._client
        session = _TimeoutSession(self.config.timeout_s)
        url = f"{self.scheme}://{self.host}/v2/"
        probe = self._with_retries(
            lambda: session.get(url, verify=self._tls_verify()), f"GET {url}"
        )
        challenge = probe.headers.get("Www-Authenticate", "")
        backend = "basic" if challenge.lower().startswith("basic") else "token"
        client = _Client(
            hostname=self.host,
            insecure=self.scheme == "http",
            tls_verify=self._tls_verify(),
            auth_backend=backend,
        )
        session.cookies = client.session.cookies
        client.session = session
        client.auth.session = session
        client.auth._auth_config = {"auths": {}}  # never read ~/.docker behind our back
        credentials = self.config.credentials_for(self.host)
        source = self.config.docker_config or "the docker config"
        if probe.status_code == 401 and credentials is None and backend == "basic":
            raise AuthenticationError(
                f"registry {self.host} requires credentials and {source} has none for it"
            )
        if probe.status_code == 401 and credentials is not None:
            client.auth.set_basic_auth(credentials.username, credentials.password)
            if backend == "basic":
                self._headers = client.auth.get_auth_header()
                check_url = url
            else:  # a token for this repository proves the credentials
                check_url = f"{self.base}/tags/list"
            rejected = f"registry {self.host} rejected the credentials of user "
            rejected += f"{credentials.username!r} from {source}"
            try:
                check = self._with_retries(
                    lambda: client.do_request(check_url, "GET", headers=dict(self._headers)),
                    f"GET {check_url}",
                )
            except AuthenticationError as error:
                raise AuthenticationError(f"{rejected} ({error})") from None
            if check.status_code in (401, 403):
                raise AuthenticationError(f"{rejected} (HTTP {check.status_code})")
        elif probe.status_code >= 400:
            self._raise_for(probe, f"GET {url}")
        self._client = client
        return client

    def _with_retries(self, send: Any, what: str) -> requests.Response:
        last: Exception | None = None
        for attempt in range(max(1, self.config.attempts)):
            if attempt:
                time.sleep(_RETRY_PAUSE_S * attempt)
            try:
                response: requests.Response = send()
            except requests.exceptions.SSLError as error:
                raise RegistryError(
                    f"TLS failure talking to {self.host} ({error}); pass the registry's CA "
                    "bundle (RegistryConfig.ca_bundle, CUVIL_REGISTRY_CA_BUNDLE)"
                ) from None
            except (requests.ConnectionError, requests.Timeout) as error:
                last = error
                continue
            except ValueError as error:  # oras: "Cannot respond to request for authentication."
                raise AuthenticationError(f"{what}: {error}") from None
            if response.status_code in (429, 502, 503, 504) or response.status_code >= 500:
                last = RegistryError(f"HTTP {response.status_code}")
                continue
            return response
        raise RegistryUnavailableError(
            f"registry {self.host} is unavailable ({what}: {last}); "
            "this is retryable: the same call may succeed later"
        )

    def _request(
        self, method: str, url: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> requests.Response:
        client = self._connect()
        merged = {**self._headers, **(headers or {})}
        response = self._with_retries(
            lambda: client.do_request(url, method, headers=dict(merged), **kwargs),
            f"{method} {url}",
        )
        if response.status_code >= 400:
            self._raise_for(response, f"{method} {url}")
        return response

    def _raise_for(self, response: requests.Response, what: str) -> None:
        detail = ""
        try:
            errors = response.json().get("errors", [])
            detail = "; ".join(str(error.get("message", error)) for error in errors)
        except ValueError:
            detail = response.text[:200]
        message = f"{what}: HTTP {response.status_code} {detail}".strip()
        if response.status_code in (401, 403):
            raise AuthenticationError(f"registry {self.host} denied access: {message}")
        if response.status_code == 404:
            raise NotFoundError(message)
        raise RegistryError(message)

    # -- manifests -----------------------------------------------------------------------------
    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        response = self._request(
            "GET", f"{self.base}/manifests/{reference}", headers={"Accept": _ACCEPT}
        )
        data = response.content
        if is_digest(reference) and sha256_digest(data) != reference:
            raise DigestMismatchError(
                f"{self.host}/{self.location.repository}: manifest {reference} arrived with "
                f"digest {sha256_digest(data)}: refused"
            )
        media_type = response.headers.get("Content-Type", mt.OCI_MANIFEST).split(";")[0]
        return data, media_type

    def resolve(self, reference: str) -> str:
        if is_digest(reference):
            return reference
        response = self._request(
            "HEAD", f"{self.base}/manifests/{reference}", headers={"Accept": _ACCEPT}
        )
        digest = response.headers.get("Docker-Content-Digest")
        if digest and is_digest(digest):
            return digest
        return sha256_digest(self.get_manifest(reference)[0])

    def put_manifest(self, data: bytes, media_type: str, tag: str | None) -> str:
        digest = sha256_digest(data)
        response = self._request(
            "PUT",
            f"{self.base}/manifests/{tag or digest}",
            headers={"Content-Type": media_type},
            data=data,
        )
        reported = response.headers.get("Docker-Content-Digest")
        if reported and reported != digest:
            raise DigestMismatchError(f"registry stored manifest as {reported}, expected {digest}")
        return digest

    def delete_manifest(self, digest: str) -> bool:
        """Delete a manifest by digest (tags on it go too); whether it was there (one already
        gone, or never pushed, is no error)."""
        try:
            self._request("DELETE", f"{self.base}/manifests/{digest}")
        except NotFoundError:
            return False
        return True

    # -- blobs ---------------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        try:
            self._request("HEAD", f"{self.base}/blobs/{digest}")
        except NotFoundError:
            return False
        return True

    def put_blob(self, blob: Blob) -> None:
        start = self._request(
            "POST", f"{self.base}/blobs/uploads/", headers={"Content-Length": "0"}
        )
        location = start.headers.get("Location", "")
        if not location:
            raise RegistryError(f"{self.host}: upload session without a Location header")
        if not location.startswith("http"):
            location = f"{self.scheme}://{self.host}{location}"
        separator = "&" if "?" in location else "?"
        self._request(
            "PUT",
            f"{location}{separator}digest={blob.digest}",
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(len(blob.data)),
            },
            data=blob.data,
        )

    def fetch_blob(self, digest: str, destination: Path) -> int:
        response = self._request("GET", f"{self.base}/blobs/{digest}", stream=True)
        hasher = hashlib.sha256()
        size = 0
        partial = destination.with_name(destination.name + ".partial")
        try:
            with response, partial.open("wb") as out:
                for chunk in response.iter_content(chunk_size=_CHUNK):
                    hasher.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        except (requests.ConnectionError, requests.Timeout) as error:
            partial.unlink(missing_ok=True)
            raise RegistryUnavailableError(
                f"registry {self.host}: download of {digest} broke off ({error}); retryable"
            ) from None
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise DigestMismatchError(
                f"{self.host}/{self.location.repository}: blob {digest} arrived with digest "
                f"{actual}: refused (corrupt or tampered content in the registry)"
            )
        partial.replace(destination)
        return size

    def referrers(self, digest: str) -> dict[str, Any] | None:
        try:
            response = self._request(
                "GET", f"{self.base}/referrers/{digest}", headers={"Accept": mt.OCI_INDEX}
            )
        except NotFoundError:
            return None  # no referrers API (CNCF Distribution 2.8): use the tag schema
        if not response.headers.get("Content-Type", "").startswith(mt.OCI_INDEX):
            return None
        document: dict[str, Any] = response.json()
        return document
