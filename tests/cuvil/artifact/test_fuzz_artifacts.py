"""Artifact fuzzing (hypothesis): a real artifact's graph.json and config.json are mutated — ops,
arguments, shapes, symbols, dtypes, sizes — and resealed (every digest recorded again, as a
forger would). Each case must, within a per-case time limit, either be refused with an
ArtifactError naming the fault, or load with only allowlisted ops and then run its golden
inputs or refuse them with a clean error. Never another exception, never a hang."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil.allowed_ops import ALLOWED_ATEN_OPS, is_allowed_op
from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import ArtifactError
from cuvil.artifact.files import ArtifactContents, decode_files, encode_files
from cuvil.ir import DTYPES
from cuvil.runtime.model import CompiledModel
from tests.fixtures.forged import reseal

CASE_LIMIT_S = 5.0  # a case past this is a hang (SIGALRM interrupts it)
GRAPH_CASES = 2000
CONFIG_CASES = 1000
# the plan's, the target's and the input binder's errors; torch's RuntimeError for a kernel
CLEAN_RUN_ERRORS = (ValueError, RuntimeError, LookupError)
counts = {"graph": 0, "config": 0, "refused": 0, "loaded": 0, "ran": 0, "run_refused": 0}

OPS = st.one_of(
    st.sampled_from(sorted(ALLOWED_ATEN_OPS)[::7]),
    st.sampled_from(
        [
            "aten.from_file.default",
            "aten.rand.default",
            "aten.empty.memory_format",
            "aten.add_.Tensor",
            "aten.save",
            "cuvil.linear",
            "cuvil.nope",
            "input",
            "const",
            "",
        ]
    ),
    st.text(max_size=12),
)
SHAPE_TEXT = st.one_of(
    st.sampled_from(
        [
            "9**9**9",
            "batch**4",
            "batch*batch*batch*batch*batch",
            "floor(batch/0)",
            "Mod(batch, 0)",
            "__import__('os')",
            "batch.__class__",
            "Max(batch, 2**40)",
            "99999999999999999999",
            "-batch",
            "batch - 100",
            "(" * 60 + "batch" + ")" * 60,
        ]
    ),
    st.lists(
        st.sampled_from(
            [
                "batch",
                "nope",
                "2",
                "1099511627776",
                "+",
                "-",
                "*",
                "//",
                "%",
                "**",
                "(",
                ")",
                ",",
                "floor",
                "Max",
            ]
        ),
        min_size=1,
        max_size=12,
    ).map("".join),
    st.text(max_size=10),
)
INTS = st.one_of(st.integers(-3, 16), st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)]))
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True),
    st.text(max_size=6),
    SHAPE_TEXT.map(lambda text: {"sym": text}),
    st.tuples(st.sampled_from(["input", "x", "nope", ""]), INTS).map(lambda v: {"v": list(v)}),
    st.sampled_from(
        [{"enum": ["dtype", "u8"]}, {"enum": ["device", "cuda"]}, {"enum": ["x", "y"]}]
    ),
    st.sampled_from([{"float": "inf"}, {"float": "nan"}, {"pickle": "gASV"}, {}]),
)
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
DIMS = st.one_of(INTS, SHAPE_TEXT, st.none(), st.floats())


def _node_mutation(graph: dict[str, Any], data: st.DataObject) -> None:
    node = data.draw(st.sampled_from(graph["nodes"]))
    field = data.draw(st.sampled_from(["op", "arg", "shape", "dtype", "types", "name", "drop"]))
    if field == "op":
        node["op"] = data.draw(OPS)
    elif field == "arg" and node["args"]:
        entry = data.draw(st.sampled_from(node["args"]))
        entry[1] = data.draw(VALUES)
    elif field == "shape" and node["types"]:
        shape = node["types"][0]["shape"]
        if shape and data.draw(st.booleans()):
            shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(DIMS)
        else:
            shape.append(data.draw(DIMS))
    elif field == "dtype" and node["types"]:
        node["types"][0]["dtype"] = data.draw(
            st.one_of(st.sampled_from(DTYPES), st.text(max_size=4))
        )
    elif field == "types":
        node["types"] = data.draw(st.one_of(st.just([]), VALUES))
    elif field == "name":
        node["name"] = data.draw(
            st.one_of(st.sampled_from([n["name"] for n in graph["nodes"]]), st.text(max_size=5))
        )
    else:
        key = data.draw(st.sampled_from(sorted(node)))
        del node[key]


def _graph_mutation(graph: dict[str, Any], data: st.DataObject) -> None:
    where = data.draw(
        st.sampled_from(["node", "node", "node", "symbol", "outputs", "new_node", "top"])
    )
    if where == "node":
        _node_mutation(graph, data)
    elif where == "symbol":
        symbol = data.draw(st.sampled_from(graph["symbols"]))
        symbol[data.draw(st.sampled_from(["name", "min", "max"]))] = data.draw(
            st.one_of(INTS, st.none(), st.text(max_size=4), st.sampled_from([10**12, 10**30]))
        )
    elif where == "outputs":
        graph["outputs"].append([data.draw(st.text(max_size=4)), data.draw(VALUES)])
    elif where == "new_node":
        producer = data.draw(st.sampled_from(graph["nodes"]))["name"]
        graph["nodes"].append(
            {
                "name": "extra",
                "op": data.draw(OPS),
                "args": [
                    ["self", {"v": [producer, 0]}],
                    [data.draw(st.text(max_size=5)), data.draw(VALUES)],
                ],
                "types": [
                    {
                        "dtype": data.draw(st.sampled_from(DTYPES)),
                        "shape": data.draw(st.lists(DIMS, max_size=3)),
                    }
                ],
            }
        )
        graph["outputs"].append(["extra", ["extra", 0]])
    else:
        key = data.draw(st.sampled_from(sorted(graph)))
        graph[key] = data.draw(VALUES)


def _config_mutation(config: dict[str, Any], data: st.DataObject) -> None:
    where = data.draw(st.sampled_from(["signature", "top", "files", "drop"]))
    if where == "signature":
        side = config["signature"][data.draw(st.sampled_from(sorted(config["signature"])))]
        if isinstance(side, list) and side and isinstance(side[0], dict):
            entry = side[0]
            key = data.draw(st.sampled_from(sorted(entry)))
            entry[key] = data.draw(st.one_of(VALUES, st.lists(DIMS, max_size=3)))
        else:
            config["signature"] = data.draw(VALUES)
    elif where == "top":
        key = data.draw(
            st.sampled_from(["target", "precision", "name", "format", "report", "shape_buckets"])
        )
        config[key] = data.draw(
            st.one_of(VALUES, st.sampled_from(["cuda-sm_90", "cpu", "bf16", "tpu"]))
        )
    elif where == "files":
        entry = config["files"][data.draw(st.sampled_from(sorted(config["files"])))]
        entry[data.draw(st.sampled_from(["size", "mediaType", "digest"]))] = data.draw(VALUES)
    else:
        del config[data.draw(st.sampled_from(sorted(config)))]


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"a case ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_case(files: dict[str, bytes]) -> None:
    """Refused cleanly, or loaded with allowlisted ops only and run (or refused) cleanly."""
    started = time.perf_counter()
    with time_limit(CASE_LIMIT_S):
        try:
            contents = decode_files(files, origin="fuzzed")
        except ArtifactError as error:
            assert str(error).startswith("fuzzed: ")
            counts["refused"] += 1
            return
        counts["loaded"] += 1
        assert all(is_allowed_op(node.op) for node in contents.graph.nodes)
        try:
            model = CompiledModel(contents)
            inputs = {k[6:]: v for k, v in contents.golden.items() if k.startswith("input.")}
            model.run(inputs)
            counts["ran"] += 1
        except CLEAN_RUN_ERRORS as error:
            assert str(error)
            counts["run_refused"] += 1

    assert time.perf_counter() - started < CASE_LIMIT_S


@pytest.fixture(scope="module")
def tiny_files(tiny_contents: ArtifactContents) -> dict[str, bytes]:
    return encode_files(tiny_contents)


def fuzz_settings(cases: int) -> settings:
    return settings(
        max_examples=cases,
        deadline=None,  # the per-case limit is CASE_LIMIT_S, enforced by check_case
        derandomize=True,  # the same cases on every run: a failure reproduces
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def test_mutated_graphs_are_refused_or_run_cleanly(tiny_files: dict[str, bytes]) -> None:
    graph = json.loads(tiny_files[mt.GRAPH_FILE])

    @fuzz_settings(GRAPH_CASES)
    @given(st.data())
    def case(data: st.DataObject) -> None:
        mutated = copy.deepcopy(graph)
        for _ in range(data.draw(st.integers(1, 3))):
            # a mutation may have taken away what a later one edits: that one is skipped
            with contextlib.suppress(KeyError, TypeError, IndexError, AttributeError):
                _graph_mutation(mutated, data)
        counts["graph"] += 1
        check_case(reseal(tiny_files | {mt.GRAPH_FILE: json.dumps(mutated).encode()}))

    torch.manual_seed(0)
    case()
    assert counts["graph"] >= GRAPH_CASES


def test_mutated_configs_are_refused_or_run_cleanly(tiny_files: dict[str, bytes]) -> None:
    config = json.loads(tiny_files[mt.CONFIG_FILE])

    @fuzz_settings(CONFIG_CASES)
    @given(st.data())
    def case(data: st.DataObject) -> None:
        mutated = copy.deepcopy(config)
        with contextlib.suppress(KeyError, TypeError, IndexError, AttributeError):
            _config_mutation(mutated, data)
        counts["config"] += 1
        # the other files' digests still hold: config.json records them, not itself
        check_case(tiny_files | {mt.CONFIG_FILE: json.dumps(mutated).encode()})

    case()
    assert counts["config"] >= CONFIG_CASES
    print("artifact fuzz cases:", counts)
