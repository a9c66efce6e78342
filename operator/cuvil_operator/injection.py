"""Sidecar injection: the pure part of the pod webhook (``webhook.py`` serves it over HTTPS).

A pod annotated ``cuvil.dev/model: <ModelCompilation name>`` gets the runtime sidecar, pinned to
the manifest digest the compilation serves (``served_ref``), sized by its own annotations
(``read_request``), with the settings the chart gives the operator (``InjectionSettings``).
``build_pod_patch`` returns the merge patch that adds it; nothing here talks to a cluster.

| annotation | meaning |
|---|---|
| ``cuvil.dev/model`` | the ModelCompilation (same namespace) whose promoted artifact is served; |
| | as a label it also selects the pod for the webhook (``objectSelector`` sees only labels) |
| ``cuvil.dev/target`` | pin that target's own artifact instead of the index over the targets |
| ``cuvil.dev/port`` | the gRPC port the app talks to on localhost (default ``CUVIL_GRPC_PORT``) |
| ``cuvil.dev/cpu`` | the sidecar's CPU request and limit; its torch threads follow the limit |
| ``cuvil.dev/memory`` | the sidecar's memory request and limit |
| ``cuvil.dev/gpu`` | NVIDIA GPUs for the sidecar (``nvidia.com/gpu``), to serve a CUDA target |
| ``cuvil.dev/registry-secret`` | a docker-config Secret in the pod's namespace to pull with |
| ``cuvil.dev/track`` | ``candidate``: a canary, pinned to ``status.candidate`` while there is |
| | one (a generation whose speed gates wait to be measured where it runs), else promoted |

A pod whose ``terminationGracePeriodSeconds`` (Kubernetes' default 30) would not cover the
sidecar's ``CUVIL_EXIT_TIMEOUT_S`` plus ``EXIT_MARGIN_S`` gets it raised to that, so that the
kubelet does not kill a sidecar still draining its calls and generation streams.

Every sidecar is told its pod and node (downward API): one that serves an artifact whose speed
gates were deferred measures it at warm-up and writes the measurement on its pod
(``cuvil_sidecar.measurement``), which ``serving`` takes for the candidate.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ANNOTATION_PREFIX = "cuvil.dev/"
MODEL_ANNOTATION = "cuvil.dev/model"
INJECTED_ANNOTATION = "cuvil.dev/injected"  # the reference the sidecar was pinned to
TRACK_ANNOTATION = "cuvil.dev/track"
PROMOTED, CANDIDATE = "promoted", "candidate"  # what a pod's sidecar follows
# the pod's own coordinates, for the sidecar to publish its measurement on
DOWNWARD_ENV = {
    "CUVIL_POD_NAME": "metadata.name",
    "CUVIL_POD_NAMESPACE": "metadata.namespace",
    "CUVIL_NODE_NAME": "spec.nodeName",
}
CONTAINER_NAME = "cuvil-sidecar"
SIDECAR_UID = 10001
SERVE_DIR = "/etc/cuvil/serve"  # the pod's cuvil.dev/injected annotation, as file "ref"
TLS_DIR, AUTH_DIR = "/etc/cuvil/tls", "/etc/cuvil/auth"  # where the chart's Secrets are mounted
DEFAULT_POLL_S = "15"  # how often a sidecar checks that file for a newly promoted digest
KUBERNETES_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it sets none
SIDECAR_EXIT_TIMEOUT_S = 5.0  # the sidecar's CUVIL_EXIT_TIMEOUT_S default
EXIT_MARGIN_S = 10  # past the sidecar's exit timeout: retiring the model, exiting
REFUSE, ADMIT = "refuse", "admit"
DIGEST_REF = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
_CPU = re.compile(r"^(?P<number>[0-9]+(\.[0-9]+)?)(?P<milli>m?)$")
_MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class InjectionRefused(Exception):
    """The pod cannot get a sidecar (the message says why and what to change)."""


@dataclass(frozen=True)
class InjectionSettings:
    """What the chart decides for every injected sidecar (``from_env``, read once).

    | variable | default | meaning |
    |---|---|---|
    | ``CUVIL_INJECT_IMAGE`` | ``ghcr.io/cuvil/cuvil-sidecar:0.1.0`` | the sidecar image |
    | ``CUVIL_INJECT_ENV`` | ``{}`` | JSON object: the sidecar's ``CUVIL_*``/``OTEL_*`` settings |
    | ``CUVIL_INJECT_CACHE_HOST_PATH`` | (emptyDir) | a node folder shared by the node's pods |
    | ``CUVIL_INJECT_SHM_SIZE`` | ``256Mi`` | the shared-memory volume's size |
    | ``CUVIL_INJECT_REGISTRY_SECRET`` | (none) | pull Secret, in the pod's own namespace |
    | ``CUVIL_INJECT_TRUSTED_KEYS`` | (none) | ConfigMap of signing keys, in the pod's namespace |
    | ``CUVIL_INJECT_TLS_SECRET`` | (none) | ``kubernetes.io/tls`` Secret: TLS on serving ports |
    | ``CUVIL_INJECT_TLS_CLIENT_CA`` | ``false`` | ``true``: mutual TLS, by the Secret's ca.crt |
    | ``CUVIL_INJECT_TOKENS_SECRET`` | (none) | Secret of bearer tokens (key ``tokens``) |
    | ``CUVIL_INJECT_UNSERVED`` | ``refuse`` | nothing to serve: ``refuse`` or ``admit`` the pod |

    The TLS and tokens Secrets are looked up in the pod's own namespace, as the pull Secret is.
    The kubelet's probes speak plaintext and carry no token, so both need the metrics port
    (probes on it), and tokens need ``CUVIL_AUTH_HEALTH`` left ``exempt``.
    """

    image: str = "ghcr.io/cuvil/cuvil-sidecar:0.1.0"
    env: Mapping[str, str] = field(default_factory=dict)
    cache_host_path: str | None = None
    shm_size: str = "256Mi"
    registry_secret: str | None = None
    trusted_keys: str | None = None
    tls_secret: str | None = None
    tls_client_ca: bool = False
    tokens_secret: str | None = None
    unserved: str = REFUSE

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> InjectionSettings:
        try:
            sidecar_env = json.loads(env.get("CUVIL_INJECT_ENV") or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"CUVIL_INJECT_ENV is not JSON: {e}") from None
        if not isinstance(sidecar_env, dict):
            raise ValueError("CUVIL_INJECT_ENV must be a JSON object of variable -> value")
        unserved = (env.get("CUVIL_INJECT_UNSERVED") or REFUSE).lower()
        if unserved not in (REFUSE, ADMIT):
            raise ValueError(f"CUVIL_INJECT_UNSERVED must be {REFUSE} or {ADMIT}, not {unserved}")
        tls_secret = env.get("CUVIL_INJECT_TLS_SECRET") or None
        tokens_secret = env.get("CUVIL_INJECT_TOKENS_SECRET") or None
        client_ca = (env.get("CUVIL_INJECT_TLS_CLIENT_CA") or "false").lower()
        if client_ca not in ("true", "false"):
            raise ValueError(f"CUVIL_INJECT_TLS_CLIENT_CA must be true or false, not {client_ca}")
        if client_ca == "true" and tls_secret is None:
            raise ValueError("CUVIL_INJECT_TLS_CLIENT_CA needs CUVIL_INJECT_TLS_SECRET")
        _check_probes_can_pass(sidecar_env, tls_secret, tokens_secret)
        exit_grace_s(sidecar_env)  # a bad value is refused here, not at each pod
        return cls(
            image=env.get("CUVIL_INJECT_IMAGE") or cls.image,
            env={str(k): str(v) for k, v in sidecar_env.items()},
            cache_host_path=env.get("CUVIL_INJECT_CACHE_HOST_PATH") or None,
            shm_size=env.get("CUVIL_INJECT_SHM_SIZE") or cls.shm_size,
            registry_secret=env.get("CUVIL_INJECT_REGISTRY_SECRET") or None,
            trusted_keys=env.get("CUVIL_INJECT_TRUSTED_KEYS") or None,
            tls_secret=tls_secret,
            tls_client_ca=client_ca == "true",
            tokens_secret=tokens_secret,
            unserved=unserved,
        )


def _check_probes_can_pass(
    sidecar_env: Mapping[str, Any], tls_secret: str | None, tokens_secret: str | None
) -> None:
    """Refuse settings under which every injected sidecar would fail its probes: the kubelet
    probes over plaintext without a token, so TLS and tokens need the (plaintext, token-free)
    metrics port to probe on."""
    if not (tls_secret or tokens_secret):
        return
    if str(sidecar_env.get("CUVIL_METRICS_PORT", "8002")) == "0":
        raise ValueError(
            "TLS or tokens for injected sidecars need CUVIL_METRICS_PORT: the kubelet's probes"
            " speak plaintext and carry no token"
        )
    if tokens_secret and str(sidecar_env.get("CUVIL_AUTH_HEALTH", "exempt")) != "exempt":
        raise ValueError(
            "CUVIL_AUTH_HEALTH=required fails the kubelet's probes of injected sidecars"
            " (they carry no token); leave it exempt"
        )


@dataclass(frozen=True)
class SidecarRequest:
    """What a pod's annotations ask of its sidecar."""

    model: str
    target: str | None = None
    port: int | None = None
    cpu: str | None = None
    memory: str | None = None
    registry_secret: str | None = None
    track: str = PROMOTED
    gpus: int = 0

    @property
    def threads(self) -> int | None:
        """Torch threads for the CPU limit: whole cores, at least one (no limit: the default)."""
        if self.cpu is None:
            return None
        return max(1, math.floor(cpu_cores(self.cpu)))


def cpu_cores(quantity: str) -> float:
    """``2`` -> 2.0, ``1500m`` -> 1.5 (the CPU quantities Kubernetes accepts, decimal form)."""
    match = _CPU.match(quantity)
    if match is None:
        raise InjectionRefused(f"cuvil.dev/cpu {quantity!r} is not a CPU quantity (e.g. 2, 500m)")
    number = float(match.group("number"))
    return number / 1000 if match.group("milli") else number


def wants_sidecar(meta: Mapping[str, Any]) -> bool:
    """The pod names a compilation, by label or annotation."""
    return bool((meta.get("labels") or {}).get(MODEL_ANNOTATION)) or bool(
        (meta.get("annotations") or {}).get(MODEL_ANNOTATION)
    )


def read_request(
    annotations: Mapping[str, str], labels: Mapping[str, str] | None = None
) -> SidecarRequest:
    """The pod's ``cuvil.dev/*`` annotations (the model may be a label instead), checked; a bad
    one refuses the pod by name."""
    model = annotations.get(MODEL_ANNOTATION) or (labels or {}).get(MODEL_ANNOTATION) or ""
    model = model.strip()
    if not _DNS_SUBDOMAIN.match(model):
        raise InjectionRefused(f"{MODEL_ANNOTATION} {model!r} is not a ModelCompilation name")
    port_text = annotations.get("cuvil.dev/port")
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise InjectionRefused(f"cuvil.dev/port {port_text!r} is not a port (1-65535)")
        port = int(port_text)
    cpu = annotations.get("cuvil.dev/cpu")
    if cpu is not None and cpu_cores(cpu) <= 0:
        raise InjectionRefused(f"cuvil.dev/cpu {cpu!r} must be more than zero")
    memory = annotations.get("cuvil.dev/memory")
    if memory is not None and not _MEMORY.match(memory):
        raise InjectionRefused(f"cuvil.dev/memory {memory!r} is not a quantity (e.g. 2Gi)")
    secret = annotations.get("cuvil.dev/registry-secret")
    if secret is not None and not _DNS_SUBDOMAIN.match(secret):
        raise InjectionRefused(f"cuvil.dev/registry-secret {secret!r} is not a Secret name")
    target = annotations.get("cuvil.dev/target")
    track = annotations.get(TRACK_ANNOTATION) or PROMOTED
    if track not in (PROMOTED, CANDIDATE):
        raise InjectionRefused(f"{TRACK_ANNOTATION} {track!r} is not {PROMOTED} or {CANDIDATE}")
    gpu_text = annotations.get("cuvil.dev/gpu") or "0"
    if not gpu_text.isdigit():
        raise InjectionRefused(f"cuvil.dev/gpu {gpu_text!r} is not a GPU count (e.g. 1)")
    return SidecarRequest(model, target or None, port, cpu, memory, secret, track, int(gpu_text))


def served_ref(compilation: Mapping[str, Any] | None, request: SidecarRequest) -> str:
    """The digest-pinned reference to serve: the promoted one (the candidate for a canary while
    there is one), else a Succeeded compilation's index (the sidecar picks its platform's
    manifest from it), or the target's own artifact when the pod names a target."""
    where = f"ModelCompilation {request.model}"
    if compilation is None:
        raise InjectionRefused(f"{where} does not exist in the pod's namespace")
    status = compilation.get("status") or {}
    served = status.get("promoted") or {}
    candidate = status.get("candidate") or {}
    if candidate and request.track == CANDIDATE:
        served = candidate
    if not served and candidate:
        raise InjectionRefused(
            f"{where} promotes nothing yet: generation {candidate.get('generation')} awaits a"
            " measurement of its speed gates (its Promoted condition says which)"
        )
    if not served and status.get("phase") == "Succeeded":  # no promotion recorded: its index
        served = {
            "ref": (status.get("index") or {}).get("ref"),
            "targets": {a.get("target"): a.get("ref") for a in status.get("artifacts") or []},
        }
    if not served:
        phase = status.get("phase") or "not started"
        raise InjectionRefused(f"{where} has no artifact to serve yet (phase {phase})")
    targets: Mapping[str, Any] = served.get("targets") or {}
    if request.target is not None:
        if request.target not in targets:
            raise InjectionRefused(
                f"{where} serves no artifact for target {request.target}"
                f" (it serves {', '.join(sorted(targets)) or 'none'})"
            )
        ref = targets[request.target]
    else:
        ref = served.get("ref") or (next(iter(targets.values())) if len(targets) == 1 else None)
        if ref is None:
            raise InjectionRefused(f"{where} has no index: name one with cuvil.dev/target")
    if not isinstance(ref, str) or not DIGEST_REF.match(ref):
        raise InjectionRefused(f"{where} serves {ref!r}, not a reference pinned by digest")
    return ref


def _probe(path: str, port: str, **extra: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, **extra}


def build_sidecar_container(
    ref: str, request: SidecarRequest, settings: InjectionSettings
) -> dict[str, Any]:
    """The sidecar container: pinned model, probes on its health endpoints, threads from its
    CPU limit, non-root with a read-only root filesystem."""
    env = {**settings.env, "CUVIL_MODEL": ref, "HOME": "/tmp"}
    env["CUVIL_MODEL_FILE"] = f"{SERVE_DIR}/ref"  # the operator moves it on a promotion
    if float(env.get("CUVIL_POLL_INTERVAL_S") or 0) <= 0:
        env["CUVIL_POLL_INTERVAL_S"] = DEFAULT_POLL_S
    env.setdefault("CUVIL_CACHE_DIR", "/var/cache/cuvil")
    if request.port is not None:
        env["CUVIL_GRPC_PORT"] = str(request.port)
    if request.threads is not None:
        env["CUVIL_TORCH_THREADS"] = str(request.threads)
    secret = request.registry_secret or settings.registry_secret
    if secret:
        env["CUVIL_REGISTRY_CONFIG"] = "/etc/cuvil/registry/config.json"
    if settings.trusted_keys:
        env["CUVIL_TRUSTED_KEYS"] = "/etc/cuvil/trust"
    if settings.tls_secret:
        env["CUVIL_TLS_CERT"], env["CUVIL_TLS_KEY"] = f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key"
        if settings.tls_client_ca:
            env["CUVIL_TLS_CLIENT_CA"] = f"{TLS_DIR}/ca.crt"
    if settings.tokens_secret:
        env["CUVIL_AUTH_TOKENS_FILE"] = f"{AUTH_DIR}/tokens"
    grpc_port = int(env.get("CUVIL_GRPC_PORT") or 8001)
    metrics_port = int(env.get("CUVIL_METRICS_PORT") or 8002)
    downward = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in DOWNWARD_ENV.items()
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": settings.image,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())] + downward,
        "ports": [{"name": "oip-grpc", "containerPort": grpc_port}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "cuvil-cache", "mountPath": env["CUVIL_CACHE_DIR"]},
            {"name": "cuvil-tmp", "mountPath": "/tmp"},
            {"name": "cuvil-serve", "mountPath": SERVE_DIR, "readOnly": True},
        ],
    }
    http_port = int(env.get("CUVIL_HTTP_PORT") or 0)
    if http_port:
        container["ports"].append({"name": "oip-http", "containerPort": http_port})
    if metrics_port:
        container["ports"].append({"name": "metrics", "containerPort": metrics_port})
        ready, live = "/v2/health/ready", "/v2/health/live"
        container["startupProbe"] = _probe(ready, "metrics", periodSeconds=5, failureThreshold=120)
        container["readinessProbe"] = _probe(ready, "metrics", periodSeconds=5)
        container["livenessProbe"] = _probe(live, "metrics", periodSeconds=10)
    else:  # no HTTP endpoint: the gRPC health service on the serving port
        grpc = {"grpc": {"port": grpc_port}}
        container["startupProbe"] = {**grpc, "periodSeconds": 5, "failureThreshold": 120}
        container["readinessProbe"] = {**grpc, "periodSeconds": 5}
        container["livenessProbe"] = {**grpc, "periodSeconds": 10}
    resources = {k: v for k, v in (("cpu", request.cpu), ("memory", request.memory)) if v}
    if request.gpus:
        resources["nvidia.com/gpu"] = str(request.gpus)
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    if env.get("CUVIL_SHARED_MEMORY", "system") != "off":
        container["volumeMounts"].append({"name": "cuvil-shm", "mountPath": "/dev/shm"})
    if secret:
        container["volumeMounts"].append(
            {"name": "cuvil-registry", "mountPath": "/etc/cuvil/registry", "readOnly": True}
        )
    if settings.trusted_keys:
        container["volumeMounts"].append(
            {"name": "cuvil-trust", "mountPath": "/etc/cuvil/trust", "readOnly": True}
        )
    if settings.tls_secret:
        container["volumeMounts"].append(
            {"name": "cuvil-tls", "mountPath": TLS_DIR, "readOnly": True}
        )
    if settings.tokens_secret:
        container["volumeMounts"].append(
            {"name": "cuvil-auth", "mountPath": AUTH_DIR, "readOnly": True}
        )
    return container


def build_sidecar_volumes(
    request: SidecarRequest, settings: InjectionSettings
) -> list[dict[str, Any]]:
    """The volumes the sidecar mounts: the node cache (a host folder when the chart names
    one, so the node's pods pull an artifact once), scratch, the reference to serve (the pod's
    ``cuvil.dev/injected`` annotation, which the kubelet rewrites when the operator moves it),
    shared memory, pull credentials, the public keys signatures are checked with, the serving
    certificate and the bearer tokens."""
    cache: dict[str, Any] = {"emptyDir": {}}
    if settings.cache_host_path:
        cache = {"hostPath": {"path": settings.cache_host_path, "type": "DirectoryOrCreate"}}
    annotation = {"fieldRef": {"fieldPath": f"metadata.annotations['{INJECTED_ANNOTATION}']"}}
    volumes = [
        {"name": "cuvil-cache", **cache},
        {"name": "cuvil-tmp", "emptyDir": {}},
        {"name": "cuvil-serve", "downwardAPI": {"items": [{"path": "ref", **annotation}]}},
    ]
    if settings.env.get("CUVIL_SHARED_MEMORY", "system") != "off":
        shm = {"medium": "Memory", "sizeLimit": settings.shm_size}
        volumes.append({"name": "cuvil-shm", "emptyDir": shm})
    secret = request.registry_secret or settings.registry_secret
    if secret:
        items = [{"key": ".dockerconfigjson", "path": "config.json"}]
        volumes.append({"name": "cuvil-registry", "secret": {"secretName": secret, "items": items}})
    if settings.trusted_keys:
        volumes.append({"name": "cuvil-trust", "configMap": {"name": settings.trusted_keys}})
    if settings.tls_secret:  # tls.crt, tls.key (and ca.crt): renewals reach the sidecar live
        volumes.append({"name": "cuvil-tls", "secret": {"secretName": settings.tls_secret}})
    if settings.tokens_secret:
        tokens = {
            "secretName": settings.tokens_secret,
            "items": [{"key": "tokens", "path": "tokens"}],
        }
        volumes.append({"name": "cuvil-auth", "secret": tokens})
    return volumes


def exit_grace_s(sidecar_env: Mapping[str, Any]) -> int:
    """The pod grace period the sidecar needs: its exit timeout plus ``EXIT_MARGIN_S``."""
    text = str(sidecar_env.get("CUVIL_EXIT_TIMEOUT_S", SIDECAR_EXIT_TIMEOUT_S)).strip()
    try:
        seconds = float(text or SIDECAR_EXIT_TIMEOUT_S)
    except ValueError:
        raise ValueError(f"CUVIL_EXIT_TIMEOUT_S={text!r} is not a number") from None
    if not seconds >= 0:  # also refuses nan
        raise ValueError(f"CUVIL_EXIT_TIMEOUT_S={text!r} must be a number of seconds >= 0")
    return math.ceil(seconds) + EXIT_MARGIN_S


def build_pod_patch(
    pod: Mapping[str, Any], ref: str, request: SidecarRequest, settings: InjectionSettings
) -> dict[str, Any]:
    """The merge patch adding the sidecar to ``pod`` (empty when it has one already). Volumes
    the pod already has under the same names are kept: an app container may mount
    ``cuvil-shm`` to share tensors with the sidecar. The pod's grace period is raised where it
    is shorter than the sidecar's drain needs, never lowered."""
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or [])
    if any(c.get("name") == CONTAINER_NAME for c in containers):
        return {}
    volumes = list(spec.get("volumes") or [])
    present = {v.get("name") for v in volumes}
    volumes += [v for v in build_sidecar_volumes(request, settings) if v["name"] not in present]
    patch_spec: dict[str, Any] = {
        "containers": [*containers, build_sidecar_container(ref, request, settings)],
        "volumes": volumes,
    }
    needed = exit_grace_s(settings.env)
    grace = spec.get("terminationGracePeriodSeconds")
    if (KUBERNETES_GRACE_S if grace is None else grace) < needed:
        patch_spec["terminationGracePeriodSeconds"] = needed
    return {"metadata": {"annotations": {INJECTED_ANNOTATION: ref}}, "spec": patch_spec}
