"""Signatures on the real Debian docker-registry: a push signed in cosign's format is accepted
under ``require``; unsigned, signed by an untrusted key, or a signature replayed from another
repository is refused (warn loads it with a warning); ``cuvil inspect`` names the signer; and
OpenSSL's own CLI verifies the signature over the simple-signing payload."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from cuvil_cli.main import main

from cuvil.artifact import push_artifact
from cuvil.artifact.api import resolve
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.signing import SIGNATURE_ANNOTATION, load_private_key, signature_tag
from cuvil.artifact.trust import TrustSettings, UntrustedArtifactError, sign_reference
from tests.cuvil.artifact.conftest import artifact_files, machine_target
from tests.fixtures.keys import make_key_pair
from tests.fixtures.registry import RunningRegistry


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: make_key_pair(tmp_path / "keys", name) for name in ("trusted", "stranger")}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUVIL_REGISTRY_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("CUVIL_TRUST_POLICY", "CUVIL_TRUSTED_KEYS"):
        monkeypatch.delenv(name, raising=False)


def _push(registry: RunningRegistry, contents: ArtifactContents, repository: str) -> str:
    target = machine_target({"cpu-x86_64": {}})
    pushed = push_artifact(
        artifact_files(contents, target, name="signed"), f"{registry.host}/{repository}:v1"
    )
    return pushed.digest


def _require(keys: dict[str, tuple[Path, Path]]) -> TrustSettings:
    return TrustSettings.load("require", [keys["trusted"][1]])


def test_signed_by_a_trusted_key_passes_require(
    registry: RunningRegistry, tiny_contents: ArtifactContents, keys, tmp_path: Path
) -> None:
    digest = _push(registry, tiny_contents, "sig/ok")
    ref = f"{registry.host}/sig/ok:v1"
    with pytest.raises(UntrustedArtifactError, match="has no signature"):
        resolve(ref, trust=_require(keys), cache_dir=tmp_path / "c1")
    assert not (tmp_path / "c1" / "artifacts" / "sha256" / digest.split(":")[1]).exists()

    signed = sign_reference(ref, load_private_key(keys["trusted"][0]), "ci-worker")
    assert signed == [digest]
    found = resolve(ref, trust=_require(keys), cache_dir=tmp_path / "c2")
    assert found.digest == digest and found.downloaded
    assert found.path == tmp_path / "c2" / "artifacts" / "sha256" / digest.split(":")[1]


def test_untrusted_key_and_replayed_signature_are_refused(
    registry: RunningRegistry, tiny_contents: ArtifactContents, keys, tmp_path: Path
) -> None:
    _push(registry, tiny_contents, "sig/stranger")
    stranger = f"{registry.host}/sig/stranger:v1"
    sign_reference(stranger, load_private_key(keys["stranger"][0]), "someone")
    with pytest.raises(UntrustedArtifactError, match="no trusted key verifies it"):
        resolve(stranger, trust=_require(keys), cache_dir=tmp_path / "c")

    # a signature made by the trusted key for the same digest in another repository
    digest = _push(registry, tiny_contents, "sig/original")
    sign_reference(f"{registry.host}/sig/original:v1", load_private_key(keys["trusted"][0]), "w")
    copy = _push(registry, tiny_contents, "sig/copy")
    assert copy == digest
    tag = signature_tag(digest)
    manifest = _get(registry, "sig/original", tag)
    for blob in [manifest["config"], *manifest["layers"]]:
        _mount(registry, blob["digest"], "sig/original", "sig/copy")
    _put(registry, "sig/copy", tag, manifest)
    with pytest.raises(UntrustedArtifactError, match="not in"):
        resolve(f"{registry.host}/sig/copy:v1", trust=_require(keys), cache_dir=tmp_path / "d")


def test_warn_loads_an_unsigned_artifact_and_says_so(
    registry: RunningRegistry,
    tiny_contents: ArtifactContents,
    keys,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    digest = _push(registry, tiny_contents, "sig/warn")
    trust = TrustSettings.load("warn", [keys["trusted"][1]])
    with caplog.at_level(logging.WARNING):
        found = resolve(f"{registry.host}/sig/warn:v1", trust=trust, cache_dir=tmp_path / "c")
    assert found.digest == digest
    assert "is not signed by a trusted key" in caplog.text and "trust policy warn" in caplog.text


def test_cli_sign_inspect_and_pull_by_policy(
    registry: RunningRegistry,
    tiny_contents: ArtifactContents,
    keys,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    digest = _push(registry, tiny_contents, "sig/cli")
    ref = f"{registry.host}/sig/cli:v1"
    trusted_pub = str(keys["trusted"][1])
    out = str(tmp_path / "out")
    pull = ["pull", ref, "-o", out, "--trust-policy", "require", "--trusted-key", trusted_pub]
    assert main(pull) == 2
    assert "has no signature" in capsys.readouterr().err

    assert main(["sign", ref, "--key", str(keys["trusted"][0]), "--signer", "release-bot"]) == 0
    assert f"signed {digest} as release-bot" in capsys.readouterr().out
    assert main(["inspect", ref, "--trusted-key", trusted_pub]) == 0
    shown = capsys.readouterr().out
    assert "signed by release-bot: verified with trusted.pub (sha256:" in shown
    assert main(["inspect", ref]) == 0
    assert "signed by release-bot: NOT verified: no trusted key verifies it" in (
        capsys.readouterr().out
    )
    assert main(pull) == 0
    assert f"pulled {ref} ({digest}" in capsys.readouterr().out


def test_openssl_verifies_the_signature_over_the_payload(
    registry: RunningRegistry, tiny_contents: ArtifactContents, keys, tmp_path: Path
) -> None:
    """Cosign's CLI is not installable here (not in Debian, PyPI or npm); the signature is a
    plain ECDSA-SHA256 over the payload blob, which OpenSSL checks on its own."""
    digest = _push(registry, tiny_contents, "sig/openssl")
    sign_reference(f"{registry.host}/sig/openssl:v1", load_private_key(keys["trusted"][0]), "w")
    (layer,) = _get(registry, "sig/openssl", signature_tag(digest))["layers"]
    payload = tmp_path / "payload.json"
    payload.write_bytes(_blob(registry, "sig/openssl", layer["digest"]))
    assert json.loads(payload.read_bytes())["critical"]["image"]["docker-manifest-digest"] == digest
    signature = tmp_path / "signature.der"
    signature.write_bytes(base64.b64decode(layer["annotations"][SIGNATURE_ANNOTATION]))
    command = ["openssl", "dgst", "-sha256", "-signature", str(signature), str(payload)]
    trusted = subprocess.run(
        [*command[:3], "-verify", str(keys["trusted"][1]), *command[3:]],
        capture_output=True,
        text=True,
    )
    assert trusted.returncode == 0 and "Verified OK" in trusted.stdout, trusted
    stranger = subprocess.run(
        [*command[:3], "-verify", str(keys["stranger"][1]), *command[3:]],
        capture_output=True,
        text=True,
    )
    assert stranger.returncode == 1 and "Verification failure" in stranger.stdout, stranger


def _get(registry: RunningRegistry, repository: str, reference: str) -> dict:
    request = urllib.request.Request(
        f"{registry.url}/v2/{repository}/manifests/{reference}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def _put(registry: RunningRegistry, repository: str, reference: str, manifest: dict) -> None:
    request = urllib.request.Request(
        f"{registry.url}/v2/{repository}/manifests/{reference}",
        data=json.dumps(manifest).encode(),
        method="PUT",
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
    )
    urllib.request.urlopen(request).close()


def _blob(registry: RunningRegistry, repository: str, digest: str) -> bytes:
    with urllib.request.urlopen(f"{registry.url}/v2/{repository}/blobs/{digest}") as response:
        return bytes(response.read())


def _mount(registry: RunningRegistry, digest: str, source: str, target: str) -> None:
    url = f"{registry.url}/v2/{target}/blobs/uploads/?mount={digest}&from={source}"
    urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST")).close()


def test_signatures_by_several_keys_are_kept_and_a_resign_replaces_its_own(
    registry: RunningRegistry, tiny_contents: ArtifactContents, keys, tmp_path: Path
) -> None:
    from cuvil.artifact.trust import check_reference

    _push(registry, tiny_contents, "sig/many")
    ref = f"{registry.host}/sig/many:v1"
    for name in ("stranger", "trusted", "trusted"):  # one signer name, two keys, one re-sign
        sign_reference(ref, load_private_key(keys[name][0]), "release")
    trusted = _require(keys).keys
    checks = check_reference(ref, trusted)
    assert len(checks) == 2
    assert sorted(check.verified for check in checks) == [False, True]
    found = resolve(ref, trust=_require(keys), cache_dir=tmp_path / "c")
    assert found.path.is_dir()


def test_cuvil_load_and_run_apply_the_trust_policy_from_the_environment(
    registry: RunningRegistry,
    tiny_contents: ArtifactContents,
    keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import cuvil

    _push(registry, tiny_contents, "sig/load")
    ref = f"{registry.host}/sig/load:v1"
    monkeypatch.setenv("CUVIL_TRUST_POLICY", "require")
    monkeypatch.setenv("CUVIL_TRUSTED_KEYS", str(keys["trusted"][1]))
    with pytest.raises(UntrustedArtifactError, match="has no signature"):
        cuvil.load(ref)
    assert main(["run", ref, "--runs", "1"]) == 2
    assert "has no signature" in capsys.readouterr().err
    saved = tmp_path / "local.cuvil"
    cuvil.jit(torch.nn.Linear(4, 2), (torch.randn(2, 4),)).save(saved)
    with pytest.raises(UntrustedArtifactError, match="local artifact"):
        cuvil.load(saved)

    sign_reference(ref, load_private_key(keys["trusted"][0]), "release-bot")
    model = cuvil.load(ref)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), tiny_contents_reference(tiny_contents, x))
    assert main(["run", ref, "--runs", "1"]) == 0
    monkeypatch.setenv("CUVIL_TRUST_POLICY", "off")
    assert cuvil.load(saved).signature.inputs[0].name


def tiny_contents_reference(contents: ArtifactContents, x: torch.Tensor) -> torch.Tensor:
    """The artifact run straight from its contents, without the registry or a policy."""
    from cuvil.runtime.model import CompiledModel

    return CompiledModel(contents)(x)
