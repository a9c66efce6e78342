"""Run an artifact in a fresh interpreter (``python -m tests.cuvil.fresh_process_runner A IN OUT``).

Loads the artifact with cuvil.load, runs each input set in IN (safetensors keys ``<case>.<input>``),
writes outputs to OUT (``<case>.<output>``) and the list of model-code modules that got imported.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from safetensors.torch import load_file, save_file

import cuvil


def main(artifact: str, inputs_path: str, outputs_path: str) -> None:
    model = cuvil.load(artifact)
    cases: dict[str, dict] = defaultdict(dict)
    for key, tensor in load_file(inputs_path).items():
        case, name = key.split(".", 1)
        cases[case][name] = tensor
    outputs = {}
    for case, inputs in cases.items():
        for name, tensor in model.run(inputs).items():
            outputs[f"{case}.{name}"] = tensor.contiguous()
    save_file(outputs, outputs_path)
    model_code = sorted(m for m in sys.modules if m.startswith(("transformers", "cuvil.models")))
    print(json.dumps({"model_code_modules": model_code}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
