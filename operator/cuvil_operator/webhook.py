"""The pod admission webhook: kopf's HTTPS server and the flow behind its mutate handler.

The API server posts an AdmissionReview for every pod created with ``cuvil.dev/model``
(the chart's MutatingWebhookConfiguration selects them); ``mutate_pod`` reads the named
ModelCompilation and answers with the JSON patch adding the sidecar (``injection``), or refuses
the pod saying why, or — with ``CUVIL_INJECT_UNSERVED=admit`` — admits it unchanged with a
warning. The server's certificate is mounted from a Secret (``CUVIL_WEBHOOK_CERT_DIR`` holding
``tls.crt`` and ``tls.key``, as a cert-manager Certificate or the chart's self-signed one
writes them); kopf re-reads the files when they are renewed.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf

from cuvil_operator.crd import GROUP, PLURAL, VERSION
from cuvil_operator.injection import (
    ADMIT,
    INJECTED_ANNOTATION,
    InjectionRefused,
    InjectionSettings,
    build_pod_patch,
    read_request,
    served_ref,
    wants_sidecar,
)
from cuvil_operator.push_secrets import get_json

WEBHOOK_ID = "sidecar"  # kopf serves a handler at /<id>: the chart's clientConfig path
ReadCompilation = Callable[[str, str], Mapping[str, Any] | None]


@dataclass(frozen=True)
class WebhookSettings:
    """Where the webhook listens (``CUVIL_WEBHOOK_LISTEN``, ``ADDR:PORT``, unset: no webhook)
    and the folder with its certificate (``CUVIL_WEBHOOK_CERT_DIR``)."""

    addr: str
    port: int
    cert_dir: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WebhookSettings | None:
        listen = env.get("CUVIL_WEBHOOK_LISTEN") or ""
        if not listen:
            return None
        addr, _, port = listen.rpartition(":")
        if not addr or not port.isdigit():
            raise ValueError(f"CUVIL_WEBHOOK_LISTEN {listen!r} is not ADDR:PORT")
        cert_dir = Path(env.get("CUVIL_WEBHOOK_CERT_DIR") or "/etc/cuvil/webhook")
        return cls(addr.strip("[]"), int(port), cert_dir)


class PodWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, giving the handler the pod's namespace: a pod created by a
    controller (generateName) reaches admission without ``metadata.namespace``; the request
    carries it beside the object."""

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def with_namespace(request: Any, **kwargs: Any) -> Any:
            payload = request.get("request") or {}
            obj = payload.get("object")
            if isinstance(obj, MutableMapping) and payload.get("namespace"):
                obj.setdefault("metadata", {}).setdefault("namespace", payload["namespace"])
            return await fn(request, **kwargs)

        async for client_config in super().__call__(with_namespace):
            yield client_config


def build_server(settings: WebhookSettings) -> kopf.WebhookServer:
    return PodWebhookServer(
        addr=settings.addr,
        port=settings.port,
        certfile=settings.cert_dir / "tls.crt",
        pkeyfile=settings.cert_dir / "tls.key",
    )


def reader(info: kopf.ConnectionInfo | None) -> ReadCompilation:
    """Reads a ModelCompilation with the operator's own API connection (None: not found)."""

    def read(namespace: str, name: str) -> Mapping[str, Any] | None:
        if info is None:
            raise kopf.AdmissionError("the operator has no API connection", code=503)
        where = f"/apis/{GROUP}/{VERSION}/namespaces/{urllib.parse.quote(namespace)}"
        try:
            return get_json(info, f"{where}/{PLURAL}/{urllib.parse.quote(name)}")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            message = f"reading {namespace}/{name}: HTTP {error.code}"
            raise kopf.AdmissionError(message, code=503) from None

    return read


def pod_mover(info: kopf.ConnectionInfo | None) -> Callable[[str, str, str], None]:
    """Re-pins a running pod's sidecar: rewrites its ``cuvil.dev/injected`` annotation (a pod
    gone meanwhile is skipped)."""

    def move(namespace: str, name: str, ref: str) -> None:
        if info is None:
            raise kopf.TemporaryError("the operator has no API connection", delay=10)
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(name)}"
        try:
            get_json(info, path, {"metadata": {"annotations": {INJECTED_ANNOTATION: ref}}})
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise kopf.TemporaryError(f"pod {namespace}/{name}: HTTP {error.code}") from None

    return move


def mutate_pod(
    body: Mapping[str, Any],
    patch: MutableMapping[str, Any],
    warnings: list[str],
    settings: InjectionSettings,
    read_compilation: ReadCompilation,
) -> None:
    """Add the sidecar to the admitted pod through kopf's ``patch``; refuse it (403, the
    message naming the annotation or the compilation) when it cannot be served."""
    meta = body.get("metadata") or {}
    if not wants_sidecar(meta):
        return
    namespace = meta.get("namespace")
    if not namespace:  # PodWebhookServer fills it in from the request
        raise kopf.AdmissionError("cuvil sidecar: the request names no namespace", code=400)
    try:
        request = read_request(meta.get("annotations") or {}, meta.get("labels") or {})
    except InjectionRefused as e:
        raise kopf.AdmissionError(f"cuvil sidecar: {e}", code=400) from None
    try:
        ref = served_ref(read_compilation(namespace, request.model), request)
    except InjectionRefused as e:
        if settings.unserved == ADMIT:
            warnings.append(f"cuvil sidecar not added: {e}")
            return
        raise kopf.AdmissionError(f"cuvil sidecar: {e}", code=403) from None
    for key, value in build_pod_patch(body, ref, request, settings).items():
        patch[key] = value
