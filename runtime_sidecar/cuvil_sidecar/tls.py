"""TLS for the sidecar's gRPC and REST ports, from mounted files (a Kubernetes TLS secret).

``CUVIL_TLS_CERT`` and ``CUVIL_TLS_KEY`` (PEM) turn TLS on; ``CUVIL_TLS_CLIENT_CA`` adds mutual
TLS: a client must present a certificate signed by that CA or the handshake fails. The files are
read when the ports open. The metrics port stays plaintext: kubelet probes and Prometheus reach
it inside the cluster, and it serves no model.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TlsError(ValueError):
    """A TLS file is missing or does not load."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None

    def pems(self) -> tuple[bytes, bytes, bytes]:
        """The certificate chain, the key and the client CA (empty without mTLS), as PEM."""
        return (
            _read(self.cert),
            _read(self.key),
            _read(self.client_ca) if self.client_ca else b"",
        )

    def server_context(self) -> ssl.SSLContext:
        """For the REST port: TLS 1.2 or later, a client certificate required with mTLS."""
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
        """For grpcio's server."""
        import grpc

        cert, key, client_ca = self.pems()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca or None, require_client_auth=bool(client_ca)
        )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TlsError(f"cannot read the TLS file {path}: {error}") from None
