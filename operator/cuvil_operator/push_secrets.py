"""Push credentials per namespace: the docker-config Secret a compilation's
``spec.output.pushSecretRef`` names, read from the compilation's own namespace.

The operator reads it with its own API credentials (the connection kopf logs in with) and
hands its docker config to the workers through the result backend's Redis, under the
compilation's chord id (``cuvil_worker.contract.store_push_config``); the request names only
the Secret, so neither the task's arguments nor any log line carries the credential.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import kopf

DOCKER_CONFIG_KEYS = (".dockerconfigjson", "config.json")


class PushSecretError(Exception):
    """The Secret is missing or holds no docker config (the message names it)."""


def connect(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    """The API connection the operator itself uses: in-cluster, else the kubeconfig."""
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | None:
    if not info.server.startswith("https"):
        return None
    context = ssl.create_default_context(cafile=info.ca_path)
    if info.ca_data:
        context.load_verify_locations(cadata=base64.b64decode(info.ca_data).decode())
    if info.insecure:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    certificate, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        folder = tempfile.mkdtemp(prefix="cuvil-operator-")
        certificate, key = f"{folder}/client.crt", f"{folder}/client.key"
        with open(certificate, "wb") as out:
            out.write(base64.b64decode(info.certificate_data))
        with open(key, "wb") as out:
            out.write(base64.b64decode(info.private_key_data))
    if certificate and key:
        context.load_cert_chain(certificate, key)
    return context


def get_json(
    info: kopf.ConnectionInfo, path: str, merge_patch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """GET ``path`` from the API server with the operator's credentials, or PATCH it with
    ``merge_patch`` (HTTPError on 4xx/5xx)."""
    data = None if merge_patch is None else json.dumps(merge_patch).encode()
    request = urllib.request.Request(
        info.server.rstrip("/") + path,
        data=data,
        method="GET" if data is None else "PATCH",
        headers={} if data is None else {"Content-Type": "application/merge-patch+json"},
    )
    if info.token:
        request.add_header("Authorization", f"{info.scheme or 'Bearer'} {info.token}")
    elif info.username and info.password:
        basic = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    with urllib.request.urlopen(request, timeout=10, context=_ssl_context(info)) as response:
        return dict(json.loads(response.read()))


def read_docker_config(info: kopf.ConnectionInfo | None, namespace: str, name: str) -> str:
    """The docker config JSON a ``kubernetes.io/dockerconfigjson`` Secret holds."""
    if info is None:
        raise PushSecretError("the operator has no API connection to read Secrets with")
    path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/secrets/{urllib.parse.quote(name)}"
    try:
        secret = get_json(info, path)
    except urllib.error.HTTPError as error:
        raise PushSecretError(
            f"Secret {namespace}/{name} (spec.output.pushSecretRef): HTTP {error.code}"
        ) from None
    data = secret.get("data") or {}
    for key in DOCKER_CONFIG_KEYS:
        if key in data:
            text = base64.b64decode(data[key]).decode()
            if "auths" not in json.loads(text):
                break
            return text
    raise PushSecretError(
        f"Secret {namespace}/{name} holds no docker config ({' or '.join(DOCKER_CONFIG_KEYS)}"
        " with auths)"
    )
