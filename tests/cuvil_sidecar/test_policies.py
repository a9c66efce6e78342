"""TLS, mutual TLS and bearer tokens on the gRPC and REST ports, with real certificates made in
the test: a client with the CA, its certificate and a token infers; one without the token is
refused UNAUTHENTICATED / 401, one without a client certificate or speaking plaintext cannot
connect; health checks need no token; a rotated token file applies without a restart; shared
memory is registered only for local, authenticated clients."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import gevent.ssl
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cuvil_sidecar.config import ConfigError, SidecarConfig
from cuvil_sidecar.errors import RateLimited, Unauthenticated
from cuvil_sidecar.policy import BearerTokens, Call, RateLimit, grpc_peer_host, is_local_peer
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.test_rest import raw_request
from tests.fixtures.certificates import Certificates, make_certificates

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}  # passed as copies: tritonclient.http adds to it


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


@pytest.fixture(scope="module", params=["native", "grpcio"])
def secured(
    request: pytest.FixtureRequest,
    mlp_artifact: Path,
    certificates: Certificates,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Sidecar, Path]]:
    folder = tmp_path_factory.mktemp("secured")
    tokens = folder / "tokens"
    tokens.write_text(f"other-token\n{TOKEN}\n")
    sidecar = Sidecar(
        mlp_artifact,
        folder / "sidecar.log",
        CUVIL_GRPC_FRONTEND=request.param,
        CUVIL_TLS_CERT=str(certificates.server_cert),
        CUVIL_TLS_KEY=str(certificates.server_key),
        CUVIL_TLS_CLIENT_CA=str(certificates.ca),
        CUVIL_AUTH_TOKENS_FILE=str(tokens),
    )
    # ready_sidecar's plaintext client cannot probe a TLS port: wait on the metrics port
    try:
        sidecar.wait_until(lambda: _ready(sidecar), timeout_s=120)
        yield sidecar, tokens
    finally:
        sidecar.stop()


def _ready(sidecar: Sidecar) -> bool:
    import urllib.request

    with urllib.request.urlopen(sidecar.metrics_url + "/v2/health/ready", timeout=5) as answer:
        return answer.status == 200


def grpc_client(sidecar: Sidecar, certificates: Certificates, **overrides: object):
    options = {
        "ssl": True,
        "root_certificates": str(certificates.ca),
        "private_key": str(certificates.client_key),
        "certificate_chain": str(certificates.client_cert),
    } | overrides
    return grpcclient.InferenceServerClient(sidecar.url, **options)


def infer_grpc(client, headers: dict | None = None) -> np.ndarray:
    item = grpcclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
    return client.infer("mlp", [item], headers=dict(headers or {})).as_numpy("output")


def http_client(sidecar: Sidecar, certificates: Certificates, client_cert: bool = True):
    options = {"ca_certs": str(certificates.ca)}
    if client_cert:
        options |= {
            "certfile": str(certificates.client_cert),
            "keyfile": str(certificates.client_key),
        }
    return httpclient.InferenceServerClient(
        sidecar.http_url,
        ssl=True,
        ssl_options=options,
        ssl_context_factory=gevent.ssl.create_default_context,
    )


def infer_http(client, headers: dict | None = None) -> np.ndarray:
    item = httpclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
    return client.infer("mlp", [item], headers=dict(headers or {})).as_numpy("output")


def test_grpc_needs_certificate_and_token(secured, certificates: Certificates) -> None:
    sidecar, _ = secured
    client = grpc_client(sidecar, certificates)
    assert client.is_server_ready()  # health: no token needed
    assert infer_grpc(client, AUTH).shape == (1, 10)
    for headers, why in (
        (None, "needs an `authorization: Bearer"),
        ({"authorization": "Bearer no"}, "not valid"),
    ):
        with pytest.raises(InferenceServerException, match=why) as caught:
            infer_grpc(client, headers)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException, match="Bearer"):
        client.get_model_metadata("mlp")  # every method but health
    client.close()
    no_cert = grpc_client(sidecar, certificates, private_key=None, certificate_chain=None)
    with pytest.raises(InferenceServerException):
        no_cert.is_server_live()  # the handshake fails without a client certificate
    no_cert.close()
    wrong_ca = grpc_client(sidecar, certificates, root_certificates=str(certificates.other_ca))
    with pytest.raises(InferenceServerException):
        wrong_ca.is_server_live()  # the server's certificate is not trusted
    wrong_ca.close()
    plaintext = grpcclient.InferenceServerClient(sidecar.url)
    with pytest.raises(InferenceServerException):
        plaintext.is_server_live()
    plaintext.close()


def test_http_needs_certificate_and_token(secured, certificates: Certificates) -> None:
    sidecar, _ = secured
    client = http_client(sidecar, certificates)
    assert client.is_server_live() and client.is_server_ready()
    assert infer_http(client, AUTH).shape == (1, 10)
    with pytest.raises(InferenceServerException, match="Bearer") as caught:
        infer_http(client)
    assert caught.value.status() == "401"
    client.close()
    no_cert = http_client(sidecar, certificates, client_cert=False)
    with pytest.raises((ssl.SSLError, OSError, HTTPConnectionClosed)):
        no_cert.is_server_live()  # the server ends the handshake without a client certificate
    no_cert.close()


def test_rotated_tokens_apply_without_restart(secured, certificates: Certificates) -> None:
    sidecar, tokens = secured
    client = grpc_client(sidecar, certificates)
    assert infer_grpc(client, AUTH).shape == (1, 10)
    original = tokens.read_text()
    tokens.write_text("rotated-token-with-another-length\n")
    try:
        with pytest.raises(InferenceServerException, match="not valid"):
            infer_grpc(client, AUTH)
        rotated = {"authorization": "Bearer rotated-token-with-another-length"}
        assert infer_grpc(client, rotated).shape == (1, 10)
    finally:
        tokens.write_text(original)
    client.close()


def test_shared_memory_needs_a_token(secured, certificates: Certificates) -> None:
    sidecar, _ = secured
    client = grpc_client(sidecar, certificates)
    with pytest.raises(InferenceServerException, match="Bearer") as caught:
        client.register_system_shared_memory("region", "/cuvil-test-none", 64)
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    status = client.get_system_shared_memory_status(headers=dict(AUTH), as_json=True)
    assert not status.get("regions")  # with the token it answers: no region registered
    client.close()


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.3.4.5:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/var/run/cuvil.sock", True),
        ("ipv4:10.1.2.3:5000", False),
        ("ipv6:[fd00::1]:5000", False),
        ("ipv4:192.168.0.7:5000", False),
        ("", False),
        ("garbage", False),
    ],
)
def test_only_local_peers_count_as_on_this_host(peer: str, local: bool) -> None:
    assert is_local_peer(grpc_peer_host(peer)) is local


def test_health_needs_a_token_when_configured(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    exempt, required = BearerTokens(tokens), BearerTokens(tokens, health_exempt=False)
    probe = Call("http", "ready", {}, "10.0.0.1")
    exempt.check(probe)
    with pytest.raises(Unauthenticated):
        required.check(probe)
    required.check(Call("grpc", "ServerReady", dict(AUTH), "10.0.0.1"))
    with pytest.raises(Unauthenticated, match="needs an `authorization: Bearer"):
        required.check(Call("grpc", "ModelInfer", {"authorization": "Basic abc"}, ""))
    with pytest.raises(Unauthenticated, match="not valid"):
        required.check(Call("grpc", "ModelInfer", {"authorization": "Bearer abc"}, ""))


def test_tls_and_token_settings_are_checked(certificates: Certificates, tmp_path: Path) -> None:
    base = {"CUVIL_MODEL": "m.cuvil"}
    with pytest.raises(ConfigError, match="go together"):
        SidecarConfig.from_env(base | {"CUVIL_TLS_CERT": str(certificates.server_cert)})
    with pytest.raises(ConfigError, match="needs CUVIL_TLS_CERT"):
        SidecarConfig.from_env(base | {"CUVIL_TLS_CLIENT_CA": str(certificates.ca)})
    with pytest.raises(ConfigError, match="is not a file"):
        SidecarConfig.from_env(base | {"CUVIL_AUTH_TOKENS_FILE": str(tmp_path / "none")})
    config = SidecarConfig.from_env(
        base
        | {
            "CUVIL_TLS_CERT": str(certificates.server_cert),
            "CUVIL_TLS_KEY": str(certificates.server_key),
        }
    )
    assert config.tls is not None and config.tls.client_ca is None
    assert config.tls.server_context().verify_mode == ssl.CERT_NONE


def test_rate_limit_per_client() -> None:
    limit = RateLimit(rate=1.0, burst=3)
    first = Call("grpc", "ModelInfer", {}, "10.0.0.1")
    for _ in range(3):
        limit.check(first)
    with pytest.raises(RateLimited, match="retry after") as caught:
        limit.check(first)
    assert 0 < caught.value.retry_after_s <= 1.0
    limit.check(Call("grpc", "ModelInfer", {}, "10.0.0.2"))  # another client has its own
    limit.check(Call("grpc", "ServerReady", {}, "10.0.0.1"))  # health is not counted
    tokened = Call("grpc", "ModelInfer", dict(AUTH), "10.0.0.1")  # a token is its own client
    limit.check(tokened)


def test_rate_limited_over_grpc_and_http(mlp_artifact: Path, tmp_path: Path) -> None:
    sidecar = Sidecar(
        mlp_artifact, tmp_path / "sidecar.log", CUVIL_RATE_LIMIT="2", CUVIL_RATE_BURST="2"
    )
    with ready_sidecar(sidecar):
        client = grpcclient.InferenceServerClient(sidecar.url)
        codes = []
        for _ in range(5):
            try:
                infer_grpc(client)
                codes.append("OK")
            except InferenceServerException as error:
                assert "retry after" in str(error)
                codes.append(error.status())
        assert codes[:2] == ["OK", "OK"] and "StatusCode.RESOURCE_EXHAUSTED" in codes[2:]
        client.close()
        statuses, retry_after = [], None
        for _ in range(5):
            status, headers, _ = raw_request(sidecar, "GET", "/v2/models/mlp")
            statuses.append(status)
            retry_after = headers.get("Retry-After", retry_after)
        assert 429 in statuses and retry_after is not None and int(retry_after) >= 1
        assert raw_request(sidecar, "GET", "/v2/health/ready")[0] == 200


def _connects_grpc(sidecar: Sidecar, ca: Path) -> bool:
    client = grpcclient.InferenceServerClient(sidecar.url, ssl=True, root_certificates=str(ca))
    try:
        return bool(client.is_server_live())
    except InferenceServerException:
        return False
    finally:
        client.close()


def _connects_http(sidecar: Sidecar, ca: Path) -> bool:
    client = httpclient.InferenceServerClient(
        sidecar.http_url,
        ssl=True,
        ssl_options={"ca_certs": str(ca)},
        ssl_context_factory=gevent.ssl.create_default_context,
    )
    try:
        return bool(client.is_server_live())
    except (ssl.SSLError, OSError, HTTPConnectionClosed):
        return False
    finally:
        client.close()


@pytest.mark.parametrize("frontend", ["native", "grpcio"])
def test_a_renewed_certificate_applies_without_restart(
    mlp_artifact: Path, tmp_path: Path, frontend: str
) -> None:
    first, renewed = make_certificates(tmp_path / "a"), make_certificates(tmp_path / "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first.server_cert.read_bytes())
    key.write_bytes(first.server_key.read_bytes())
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND=frontend,
        CUVIL_TLS_CERT=str(cert),
        CUVIL_TLS_KEY=str(key),
        CUVIL_TLS_RELOAD_S="1",
    )
    try:
        sidecar.wait_until(lambda: _ready(sidecar), timeout_s=120)
        assert _connects_grpc(sidecar, first.ca) and _connects_http(sidecar, first.ca)
        assert not _connects_grpc(sidecar, renewed.ca)
        assert not _connects_http(sidecar, renewed.ca)
        key.write_bytes(renewed.server_key.read_bytes())  # as a rewritten secret would be
        cert.write_bytes(renewed.server_cert.read_bytes())
        sidecar.wait_until(lambda: _connects_grpc(sidecar, renewed.ca), timeout_s=15)
        sidecar.wait_until(lambda: _connects_http(sidecar, renewed.ca), timeout_s=15)
        assert not _connects_grpc(sidecar, first.ca)
        assert not _connects_http(sidecar, first.ca)
    finally:
        sidecar.stop()
