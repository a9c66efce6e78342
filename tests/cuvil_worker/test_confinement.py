"""Sources stay where they belong: a PVC claim cannot name a folder outside the volumes."""

from __future__ import annotations

import pytest
from cuvil_operator.spec_checks import check_spec
from cuvil_worker.errors import InvalidSpec
from cuvil_worker.tasks import confine_source

BASE = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    "targets": ["cpu-x86_64"],
    "output": {"repository": "reg:5000/m"},
}


@pytest.mark.parametrize("claim", ["../../../../etc", "a/b", "..", "/etc", "Upper"])
def test_a_claim_that_is_not_a_pvc_name_is_refused_by_both(claim: str) -> None:
    spec = {**BASE, "source": {"pvc": {"claimName": claim, "path": "model"}}}
    with pytest.raises(InvalidSpec, match="claimName"):
        confine_source(spec)
    assert any(p.field == "spec.source.pvc.claimName" for p in check_spec(spec)), claim


def test_a_pvc_name_passes() -> None:
    spec = {**BASE, "source": {"pvc": {"claimName": "models-v2.team", "path": "bert"}}}
    confine_source(spec)
    assert check_spec(spec) == []
