"""The worker's signing settings: no key, no signer; a mounted key (encrypted, with its password
file) gives a signer named by CUVIL_SIGNER; a wrong password fails naming the key file."""

from __future__ import annotations

from pathlib import Path

import pytest
from cuvil_worker.config import WorkerConfig

from cuvil.artifact.signing import SigningKeyError, key_id, load_public_keys
from tests.fixtures.keys import make_key_pair


def test_no_key_means_unsigned_pushes() -> None:
    assert WorkerConfig.from_env({}).signer() is None


def test_a_mounted_key_with_its_password_file_signs(tmp_path: Path) -> None:
    key, public = make_key_pair(tmp_path, "worker", password="pw")
    (tmp_path / "password").write_text("pw\n")
    config = WorkerConfig.from_env(
        {
            "CUVIL_SIGNING_KEY": str(key),
            "CUVIL_SIGNING_KEY_PASSWORD_FILE": str(tmp_path / "password"),
            "CUVIL_SIGNER": "team-a",
        }
    )
    signer = config.signer()
    assert signer is not None and signer.name == "team-a"
    (trusted,) = load_public_keys([public])
    assert key_id(signer.key.public_key()) == trusted.key_id


def test_a_wrong_password_is_refused_naming_the_key(tmp_path: Path) -> None:
    key, _ = make_key_pair(tmp_path, "worker", password="pw")
    (tmp_path / "password").write_text("nope")
    config = WorkerConfig.from_env(
        {
            "CUVIL_SIGNING_KEY": str(key),
            "CUVIL_SIGNING_KEY_PASSWORD_FILE": str(tmp_path / "password"),
        }
    )
    with pytest.raises(SigningKeyError, match=r"worker\.key"):
        config.signer()
