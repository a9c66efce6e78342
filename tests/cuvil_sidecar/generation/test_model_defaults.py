"""What a generate request leaves out comes from the model's generation config, as transformers'
``generate`` (Triton's generate extension, gRPC) and vLLM (OpenAI's API) read it: the parameter
rules, and a sidecar serving a checkpoint whose ``generation_config.json`` sets a repetition
penalty, answering transformers' tokens for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cuvil_sidecar.generation.openai_api import _sampling
from cuvil_sidecar.generation.requests import read_parameters

from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.generation.checkpoints import tiny_llama_checkpoint
from tests.cuvil_sidecar.generation.clients import post

INSTRUCT = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
INSTRUCT |= {"repetition_penalty": 1.05}


@pytest.mark.parametrize(
    ("request_parameters", "defaults", "expected"),
    [
        ({}, {}, (False, 1.0, 50, 1.0, 1.0)),
        ({}, INSTRUCT, (True, 0.7, 20, 0.8, 1.05)),
        ({"temperature": 0}, INSTRUCT, (False, 1.0, 20, 0.8, 1.05)),  # greedy, penalized
        ({"do_sample": False}, INSTRUCT, (False, 1.0, 20, 0.8, 1.05)),
        ({"temperature": 1.2, "top_k": 5}, INSTRUCT, (True, 1.2, 5, 0.8, 1.05)),
        ({"repetition_penalty": 1.0}, INSTRUCT, (True, 0.7, 20, 0.8, 1.0)),
        ({}, {"temperature": 0.6}, (False, 1.0, 50, 1.0, 1.0)),  # no do_sample: greedy
        ({"temperature": 0.6}, {}, (True, 0.6, 50, 1.0, 1.0)),
    ],
)
def test_the_models_defaults_fill_what_a_request_leaves_out(
    request_parameters: dict[str, Any], defaults: dict[str, Any], expected: tuple
) -> None:
    params, _ = read_parameters(request_parameters, (2,), defaults)
    got = (params.do_sample, params.temperature, params.top_k, params.top_p)
    assert (*got, params.repetition_penalty) == expected


def test_openai_requests_take_the_models_values_before_openais_defaults() -> None:
    taken = _sampling({"prompt": "x"}, 16, INSTRUCT)
    assert {key: taken[key] for key in ("temperature", "top_k", "top_p", "repetition_penalty")} == {
        "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
    }  # fmt: skip
    assert _sampling({"prompt": "x", "temperature": 0}, 16, INSTRUCT)["temperature"] == 0
    assert (_sampling({}, 16, {})["temperature"], _sampling({}, 16, {})["top_k"]) == (1.0, 0)


@pytest.fixture(scope="module")
def penalized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer=True)
    config = json.loads((folder / "generation_config.json").read_text())
    config |= {"repetition_penalty": 1.6, "top_k": 7}  # greedy, as transformers reads it
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def sidecar(penalized: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    log = tmp_path_factory.mktemp("defaults") / "sidecar.log"
    with ready_sidecar(Sidecar(penalized, log, CUVIL_GENERATION_SLOTS="2")) as ready:
        yield ready


def test_a_served_checkpoints_generation_config_gives_transformers_tokens(
    sidecar: Sidecar, penalized: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(penalized, local_files_only=True).eval()
    assert model.generation_config.repetition_penalty == 1.6
    prompt = [5, 9, 5, 9, 17, 5, 9, 33, 5]
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, eos_token_id=None)
    expected = out[0, len(prompt) :].tolist()
    body = {"input_ids": prompt, "parameters": {"max_tokens": 24, "ignore_eos": True}}
    status, answer = post(sidecar, "/v2/models/tiny/generate", body)
    assert status == 200, answer
    assert answer["output_ids"] == expected
    plain = {**body, "parameters": {**body["parameters"], "repetition_penalty": 1.0}}
    status, unpenalized = post(sidecar, "/v2/models/tiny/generate", plain)
    assert status == 200 and unpenalized["output_ids"] != expected
