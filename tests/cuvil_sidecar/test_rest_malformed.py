"""Bad input never crashes the REST port: hypothesis sends hundreds of malformed infer requests
(JSON that does not parse or does not fit, wrong binary lengths and header lengths, huge
declared shapes and sizes) and each gets a clean 4xx with {"error": ...}; broken framing (bad
request lines, oversized headers, chunked bodies, bodies cut short) is refused or dropped; and
a valid request afterwards still succeeds."""

from __future__ import annotations

import json
import socket

import numpy as np
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cuvil_sidecar.conftest import Sidecar
from tests.cuvil_sidecar.test_rest import raw_request

DATATYPES = ["FP32", "FP16", "BF16", "INT64", "INT8", "UINT8", "BOOL", "BYTES", "fp32"]
dims = st.one_of(st.integers(-2, 4), st.sampled_from([784, 0, 65, 2**31, 2**62, 10**30]))
scalar = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.booleans(), st.text(max_size=3)
)
data = st.recursive(st.lists(scalar, max_size=8), lambda inner: st.lists(inner, max_size=3))
tensor_parameters = st.one_of(
    st.none(),
    st.fixed_dictionaries({"binary_data_size": st.one_of(st.integers(-5, 80), st.just(2**62))}),
    st.dictionaries(st.sampled_from(["binary_data_size", "shared_memory_region"]), scalar),
    st.just("not an object"),
)
tensor = st.fixed_dictionaries(
    {
        "name": st.one_of(st.just("x"), st.text(max_size=4), st.integers()),
        "datatype": st.sampled_from(DATATYPES),
        "shape": st.one_of(st.lists(dims, max_size=3), st.just("784")),
    },
    optional={"data": data, "parameters": tensor_parameters},
)
document = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(tensor, max_size=3), st.just({}), st.none())},
    optional={
        "id": st.one_of(st.text(max_size=4), st.integers()),
        "outputs": st.one_of(
            st.lists(st.fixed_dictionaries({"name": st.sampled_from(["output", "y"])}), max_size=2),
            st.just("output"),
        ),
        "parameters": st.one_of(
            st.fixed_dictionaries({"binary_data_output": st.booleans()}),
            st.fixed_dictionaries({"timeout": st.one_of(st.integers(-5, 10), st.just("1"))}),
        ),
    },
)
bodies = st.one_of(
    st.binary(max_size=64),  # not JSON at all
    st.text(max_size=40).map(str.encode),
    document.map(lambda d: json.dumps(d).encode()).flatmap(
        lambda text: st.sampled_from([text, text[: len(text) // 2], text + b"}"])
    ),
)
header_lengths = st.one_of(
    st.none(), st.just("exact"), st.integers(-3, 200).map(str), st.sampled_from(["", "x", "1e3"])
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies, tail=st.binary(max_size=64), header_length=header_lengths)
def test_fuzzed_infer_requests_get_clean_4xx(
    mlp_sidecar: Sidecar, body: bytes, tail: bytes, header_length: str | None
) -> None:
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        length = str(len(body)) if header_length == "exact" else header_length
        headers["Inference-Header-Content-Length"] = length
        body += tail
    status, answer_headers, answer = raw_request(
        mlp_sidecar, "POST", "/v2/models/mlp/infer", body, headers
    )
    assert 400 <= status < 500, (status, body[:200], answer[:300])
    assert answer_headers["Content-Type"] == "application/json"
    assert json.loads(answer)["error"]


def send_raw(sidecar: Sidecar, data: bytes, *, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", sidecar.http_port), timeout=30) as sock:
        sock.sendall(data)
        if not read:
            return b""
        chunks = []  # until the server closes: each case ends with a refusal or Connection: close
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_broken_framing_is_refused_and_the_server_serves_on(mlp_sidecar: Sidecar) -> None:
    path = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v2 HTTP/2.0\r\n\r\n", 505),
        (b"GET /v2 HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET /v2 HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (path + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411),
        (path + b"Content-Length: -4\r\n\r\n", 400),
        (path + b"Content-Length: 1099511627776\r\n\r\n", 413),  # 1 TiB declared, none sent
        (path + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\nab", 400),
    ]
    for data, status in cases:
        assert status_of(send_raw(mlp_sidecar, data)) == status, data[:80]
    # a body cut short: the client goes away, the server drops the connection and serves on
    send_raw(mlp_sidecar, path + b'Content-Length: 1000\r\n\r\n{"inputs"', read=False)
    # two requests on one connection, the first malformed: each answered in turn
    pipelined = send_raw(
        mlp_sidecar,
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nContent-Length: 1\r\n\r\n{"
        b"GET /v2/health/ready HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    assert pipelined.count(b"HTTP/1.1 400") == 1 and pipelined.count(b"HTTP/1.1 200") == 1
    client = httpclient.InferenceServerClient(mlp_sidecar.http_url)
    item = httpclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), dtype=np.float32))
    assert client.infer("mlp", [item]).as_numpy("output").shape == (1, 10)
    client.close()
    status, _, _ = raw_request(mlp_sidecar, "GET", "/v2/health/ready")
    assert status == 200
