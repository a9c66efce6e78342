"""TLS for the sidecar's gRPC and REST ports, from mounted files (a Kubernetes TLS secret).

``CUVIL_TLS_CERT`` and ``CUVIL_TLS_KEY`` (PEM) turn TLS on; ``CUVIL_TLS_CLIENT_CA`` adds mutual
TLS: a client must present a certificate signed by that CA or the handshake fails. A renewed
certificate (cert-manager rewriting the mounted secret) applies without a restart: the native
gRPC front end has gRPC C++ watch the files (every ``reload_s``), grpcio's server and the REST
port look at them on each new connection and load them again once they changed. Files that
fail to load then are logged and the certificate loaded before stays. On the REST port a new
client CA is added to the ones trusted until a restart. The metrics port stays plaintext:
kubelet probes and Prometheus reach it inside the cluster, and it serves no model.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("cuvil_sidecar.tls")


class TlsError(ValueError):
    """A TLS file is missing or does not load."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None
    reload_s: int = 30

    def stamp(self) -> tuple[tuple[int, int] | None, ...]:
        """What changes when a file is rewritten: each one's mtime and size."""
        stamps = []
        for path in (self.cert, self.key, self.client_ca):
            try:
                status = os.stat(path) if path is not None else None
            except OSError:
                status = None
            stamps.append((status.st_mtime_ns, status.st_size) if status else None)
        return tuple(stamps)

    def native_arguments(self) -> tuple[bytes, bytes, bytes, int]:
        """The native front end's TLS arguments: the three paths and the watch interval."""
        ca = str(self.client_ca).encode() if self.client_ca else b""
        return str(self.cert).encode(), str(self.key).encode(), ca, self.reload_s

    def pems(self) -> tuple[bytes, bytes, bytes]:
        """The certificate chain, the key and the client CA (empty without mTLS), as PEM."""
        return (
            _read(self.cert),
            _read(self.key),
            _read(self.client_ca) if self.client_ca else b"",
        )

    def server_context(self) -> ssl.SSLContext:
        """For the REST port: TLS 1.2 or later, a client certificate required with mTLS; each
        handshake looks whether the files changed and, if so, takes the new certificate."""
        context = self._context()
        seen = [self.stamp()]

        def on_client_hello(sock: ssl.SSLObject, server_name: str | None, _: object) -> None:
            stamp = self.stamp()
            if stamp == seen[0]:
                return
            seen[0] = stamp
            try:
                fresh = self._context()
            except TlsError as error:
                log.error("%s; keeping the certificate loaded before", error)
                return
            context.load_cert_chain(self.cert, self.key)  # for the connections to come
            if self.client_ca is not None:
                context.load_verify_locations(cafile=self.client_ca)
            sock.context = fresh  # and for this one
            log.info("TLS files changed: loaded the new certificate from %s", self.cert)

        context.sni_callback = on_client_hello
        return context

    def _context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
            if self.client_ca is not None:
                context.load_verify_locations(cafile=self.client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as error:
            raise TlsError(f"cannot load the TLS files {self}: {error}") from None
        return context

    def grpc_credentials(self) -> Any:
        """For grpcio's server: asked for the configuration again on each new connection."""
        import grpc

        def configuration() -> Any:
            cert, key, client_ca = self.pems()
            return grpc.ssl_server_certificate_configuration(
                [(key, cert)], root_certificates=client_ca or None
            )

        seen = [self.stamp()]

        def fetch() -> Any:
            stamp = self.stamp()
            if stamp == seen[0]:
                return None  # unchanged: grpc keeps the one it has
            seen[0] = stamp
            try:
                loaded = configuration()
            except TlsError as error:
                log.error("%s; keeping the certificate loaded before", error)
                return None
            log.info("TLS files changed: loaded the new certificate from %s", self.cert)
            return loaded

        return grpc.dynamic_ssl_server_credentials(
            configuration(), fetch, require_client_authentication=self.client_ca is not None
        )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TlsError(f"cannot read the TLS file {path}: {error}") from None
