"""The batcher on its own: requests joined up to max_rows, results split back row for row,
incompatible shapes kept apart, and a request that breaks a joined batch fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
import torch
from cuvil_sidecar.batcher import Batcher
from cuvil_sidecar.errors import ShuttingDown


def double(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    if torch.isnan(x).any():
        raise RuntimeError("NaN in the batch")
    return {"y": x * 2, "rows": torch.arange(x.shape[0])}


def test_join_split_and_isolation() -> None:
    async def scenario() -> None:
        executions: list[int] = []
        batcher = Batcher(
            double,
            max_rows=8,
            max_delay_s=0.05,
            on_execute=lambda requests, rows: executions.append(rows),
        )
        xs = [torch.full((1 + i % 3, 4), float(i)) for i in range(6)]
        results = await asyncio.gather(
            *(batcher.submit({"x": x}, rows=len(x), key=(4,)) for x in xs)
        )
        for x, result in zip(xs, results, strict=True):
            assert torch.equal(result.outputs["y"], x * 2)
        assert max(r.batch_requests for r in results) > 1
        assert all(rows <= 8 for rows in executions) and sum(executions) == 12

        odd = torch.ones(2, 5)  # a different non-batch dim: never joined with the others
        mixed = await asyncio.gather(
            batcher.submit({"x": torch.ones(2, 4)}, rows=2, key=(4,)),
            batcher.submit({"x": odd}, rows=2, key=(5,)),
        )
        assert mixed[1].batch_requests == 1 and mixed[1].outputs["y"].shape == (2, 5)

        poisoned = torch.full((1, 4), float("nan"))
        outcomes = await asyncio.gather(
            *(
                batcher.submit({"x": x}, rows=1, key=(4,))
                for x in (torch.ones(1, 4), poisoned, torch.zeros(1, 4))
            ),
            return_exceptions=True,
        )
        assert isinstance(outcomes[1], RuntimeError)
        assert torch.equal(outcomes[0].outputs["y"], torch.full((1, 4), 2.0))
        assert torch.equal(outcomes[2].outputs["y"], torch.zeros(1, 4))
        await batcher.close()
        with pytest.raises(ShuttingDown, match="unloaded"):
            await batcher.submit({"x": torch.ones(1, 4)}, rows=1, key=(4,))

    asyncio.run(scenario())
