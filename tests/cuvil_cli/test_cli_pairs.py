"""``KEY=VALUE`` arguments: what ``cuvil push --annotation`` and ``sidecar_ab.py --env`` take."""

from __future__ import annotations

import pytest
from cuvil_cli.pairs import key_values


def test_pairs_become_a_mapping_and_values_keep_their_equals_signs() -> None:
    pairs = ["a=1", "org.opencontainers.image.title=x=y", "empty=", "a=2"]
    assert key_values(pairs, "--annotation") == {
        "a": "2",
        "org.opencontainers.image.title": "x=y",
        "empty": "",
    }


@pytest.mark.parametrize("pair", ["novalue", "=value", ""])
def test_a_pair_without_a_key_or_equals_sign_names_the_flag(pair: str) -> None:
    with pytest.raises(ValueError, match=rf"--env wants KEY=VALUE, got {pair!r}"):
        key_values(["ok=1", pair], "--env")
