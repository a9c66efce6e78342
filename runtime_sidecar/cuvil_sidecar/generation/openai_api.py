"""OpenAI's completions API over a generation model, as vLLM, TGI and Triton's OpenAI front end
serve it, so that OpenAI's client libraries work unchanged:

    GET  /v1/models             the generation model served
    POST /v1/completions        a prompt (text, or token ids) -> text
    POST /v1/chat/completions   messages, through the model's chat template (chat.py) -> a message

Both POST routes run the same scheduler as the generate extension, and take ``model``,
``stream`` (server-sent events: a chunk per token that completes text, the last with its
``finish_reason``, then ``data: [DONE]``; ``stream_options.include_usage`` adds a chunk with the
usage), ``max_tokens`` (chat also ``max_completion_tokens``; default 16 for completions, and for
chat what the model's ``max_seq`` leaves), ``temperature`` (default 1, sampled; 0 is greedy),
``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``, ``user``
(ignored), and vLLM's ``top_k`` (off unless given), ``repetition_penalty``, ``ignore_eos`` and
``stop_token_ids``; temperature, top-k, top-p and the repetition penalty a request leaves out
come from the model's generation config where it sets them, as vLLM takes them; ``logprobs``
(and chat's ``top_logprobs``) for the generated tokens (``openai_logprobs.py``). A field this
server does not do (``n`` or ``best_of`` above 1, ``echo``, ``suffix``, ``logit_bias``, tools)
or does not know is refused with 400 naming it, never ignored. Errors
are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the generate
extension's status (400, 404 for another model's name, 413 past the KV budget, 429 with a full
queue, 503 stopping). The answers carry text, so
the model needs its tokenizer. Usage counts the prompt tokens prefix reuse copied (the
scheduler's) as ``prompt_tokens_details.cached_tokens``, as OpenAI counts its prompt caching.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cuvil_sidecar.dataplane import DataPlane
from cuvil_sidecar.errors import InvalidInput, SidecarError, http_status
from cuvil_sidecar.generation.chat import read_messages, render_chat
from cuvil_sidecar.generation.openai_logprobs import chat_logprobs, completion_logprobs, requested
from cuvil_sidecar.generation.requests import GenerateRequest, read_parameters, read_prompt
from cuvil_sidecar.generation.rest_generate import TokenEvents, sse_event
from cuvil_sidecar.generation.sequences import FINISH_ERROR, FINISH_SHUTDOWN
from cuvil_sidecar.generation.servable import (
    GeneratedToken,
    GenerationServable,
    GenerationStream,
    ended_error,
)
from cuvil_sidecar.http_server import HttpRequest, HttpResponse, json_response
from cuvil_sidecar.json_body import json_object

DONE = b"data: [DONE]\n\n"  # the last event of a streamed answer, as OpenAI sends it
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for completions
SAMPLING = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop", "top_k"}) | {
    "presence_penalty", "frequency_penalty"
}  # fmt: skip
VLLM = frozenset({"ignore_eos", "stop_token_ids", "repetition_penalty"})
COMMON = SAMPLING | VLLM | {"model", "stream", "stream_options", "user", "n", "logprobs"}
# fields taken only at the value that asks for nothing this server does not do
HARMLESS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
}
COMPLETION_KEYS = COMMON | {"prompt", "best_of", "echo", "suffix", "logit_bias"}
CHAT_KEYS = (COMMON | set(HARMLESS) | {"messages", "max_completion_tokens", "top_logprobs"}) - {
    "best_of", "echo"
}  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """What differs between the two routes' answers."""

    id_prefix: str
    answer: str  # the object type of a whole answer
    chunk: str  # of a streamed chunk
    chat: bool


COMPLETION = Kind("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Kind("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


def models(dataplane: DataPlane) -> HttpResponse:
    current = dataplane.manager.current
    data = []
    if isinstance(current, GenerationServable):
        entry = {"id": current.name, "object": "model", "created": int(time.time())}
        data.append(entry | {"owned_by": "cuvil"})
    return json_response(200, {"object": "list", "data": data})


async def completions(dataplane: DataPlane, request: HttpRequest) -> HttpResponse:
    return await _answer(dataplane, request, COMPLETION)


async def chat_completions(dataplane: DataPlane, request: HttpRequest) -> HttpResponse:
    return await _answer(dataplane, request, CHAT)


def error_answer(error: SidecarError) -> HttpResponse:
    status = http_status(error)
    return json_response(status, _error_body(str(error), status))


async def _answer(dataplane: DataPlane, request: HttpRequest, kind: Kind) -> HttpResponse:
    try:
        body = _body(request.body, CHAT_KEYS if kind.chat else COMPLETION_KEYS)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidInput("model is required: the name GET /v1/models lists")
        streaming = _flag(body, "stream")
        usage_chunk = streaming and _include_usage(body)
        answer_id = kind.id_prefix + uuid.uuid4().hex
        top = requested(body, kind.chat)
        read = (_chat_reader if kind.chat else _completion_reader)(body, answer_id, top)
        stream = dataplane.open_generation(model, "", read)
    except SidecarError as error:
        return error_answer(error)
    header = {"id": answer_id, "created": int(time.time()), "model": model}
    if streaming:
        chunks = _chunks(stream, header | {"object": kind.chunk}, kind, usage_chunk, top)
        return HttpResponse(200, content_type="text/event-stream", stream=chunks)
    try:
        last = await stream.last()
    finally:
        stream.close()
    if last.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
        return error_answer(ended_error(last.finish, last.error))
    choice: dict[str, Any] = {"index": 0}
    if kind.chat:
        choice["message"] = {"role": "assistant", "content": stream.text}
    else:
        choice["text"] = stream.text
    scored = None if top is None else _logprobs(stream, stream.scored, kind)
    choice |= {"logprobs": scored, "finish_reason": stream.finish}
    answer = header | {"object": kind.answer, "choices": [choice], "usage": _usage(stream)}
    return json_response(200, answer)


def _chunks(
    stream: GenerationStream,
    header: dict[str, Any],
    kind: Kind,
    usage_chunk: bool,
    top: int | None,
) -> TokenEvents:
    """The streamed answer: for a chat, a first chunk with the assistant's role; a chunk per
    token that completes text or ends the answer (with the log-probabilities of the tokens
    since the last chunk, where asked); the usage chunk where asked; ``[DONE]``. An error after
    the stream began comes as an error object, then ``[DONE]``."""

    chunk = chunk_writer(header, kind.chat)
    pending: list[GeneratedToken] = []  # scored tokens not in a chunk yet
    written = 0  # characters of text in chunks so far: a completion's text offsets

    def frames(token: GeneratedToken) -> list[bytes]:
        nonlocal written
        if token.finish in (FINISH_ERROR, FINISH_SHUTDOWN):
            error = ended_error(token.finish, token.error)
            return [sse_event(_error_body(str(error), http_status(error))), DONE]
        parts = []
        if token.logprobs is not None:
            pending.append(token)
        if token.text or token.finish is not None:
            scored = None
            if top is not None:
                scored = _logprobs(stream, pending, kind, written)
                pending.clear()
            written += len(token.text)
            text = token.text or None if kind.chat else token.text
            parts.append(chunk(text, token.finish, logprobs=scored))
        if token.finish is not None:
            if usage_chunk:
                parts.append(sse_event(header | {"choices": [], "usage": _usage(stream)}))
            parts.append(DONE)
        return parts

    return TokenEvents(stream, frames, (chunk("", None, role=True),) if kind.chat else ())


def chunk_writer(header: dict[str, Any], chat: bool) -> Callable[..., bytes]:
    """A streamed answer's chunk, ``chunk(text, finish, role=False, logprobs=None)``: the event
    ``sse_event`` writes for ``header | {"choices": [choice]}``, the choice a chat's ``delta``
    (the role where asked, the text unless None) or a completion's ``text``, then ``logprobs``
    and ``finish_reason``; written from the header's JSON encoded once, as a stream sends a chunk
    per token."""
    opening = b"data: " + _json(header)[:-1] + b',"choices":[{"index":0,'

    def chunk(
        text: str | None, finish: str | None, role: bool = False, logprobs: Any = None
    ) -> bytes:
        if chat:
            fields = [b'"role":"assistant"'] if role else []
            if text is not None:
                fields.append(b'"content":' + _json(text))
            choice = b'"delta":{' + b",".join(fields) + b"}"
        else:
            choice = b'"text":' + _json(text or "")
        scored = b',"logprobs":' + (b"null" if logprobs is None else _json(logprobs))
        return opening + choice + scored + b',"finish_reason":' + _json(finish) + b"}]}\n\n"

    return chunk


def _json(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps's, made once rather than per call


def _logprobs(
    stream: GenerationStream, tokens: list[GeneratedToken], kind: Kind, offset: int = 0
) -> dict[str, Any]:
    codec = stream.codec
    assert codec is not None  # OpenAI's routes serve models with a tokenizer only
    if kind.chat:
        return chat_logprobs(tokens, codec)
    return completion_logprobs(tokens, codec, offset)


def _completion_reader(
    body: dict[str, Any], answer_id: str, top: int | None
) -> Callable[[GenerationServable], GenerateRequest]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt):
        raise InvalidInput("prompt: one prompt a request here (a string or a list of token ids)")
    if not isinstance(prompt, str | list) or not prompt:
        raise InvalidInput("prompt must be a non-empty string or list of token ids")
    ids = read_prompt(prompt, "prompt") if isinstance(prompt, list) else None
    text = prompt if isinstance(prompt, str) else None

    def read(model: GenerationServable) -> GenerateRequest:
        _needs_text(model)
        parameters = _sampling(body, COMPLETION_DEFAULT_TOKENS, model.model.sampling_defaults)
        params, stop = read_parameters(parameters, _eos(model))
        return GenerateRequest(ids, text, params, stop, answer_id, logprobs=top)

    return read


def _chat_reader(
    body: dict[str, Any], answer_id: str, top: int | None
) -> Callable[[GenerationServable], GenerateRequest]:
    messages = read_messages(body.get("messages"))

    def read(model: GenerationServable) -> GenerateRequest:
        codec = _needs_text(model)
        template = codec.chat_template
        if template is None:
            raise InvalidInput(
                f"model {model.name!r} has no chat template in its tokenizer files: "
                "use /v1/completions with the prompt written out"
            )
        prompt = codec.encode(render_chat(template, messages, codec.special_tokens), special=False)
        default = model.scheduler.engine.max_seq  # the scheduler cuts it to what max_seq leaves
        parameters = _sampling(body, default, model.model.sampling_defaults)
        params, stop = read_parameters(parameters, _eos(model))
        return GenerateRequest(prompt, None, params, stop, answer_id, logprobs=top)

    return read


def _sampling(
    body: dict[str, Any], default_tokens: int, model_defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The body's sampling fields as the generate extension's parameters (requests.py); what
    the body leaves out of temperature, top-k, top-p and the repetition penalty from the
    model's generation config (as vLLM does), else OpenAI's defaults: temperature 1 (sampled),
    top_k off."""
    parameters = {key: body[key] for key in SAMPLING | VLLM if body.get(key) is not None}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if key in model_defaults and key not in parameters:
            parameters[key] = model_defaults[key]
    for alias in ("max_completion_tokens",):  # chat's newer name for max_tokens
        if body.get(alias) is not None:
            if "max_tokens" in parameters:
                raise InvalidInput(f"give max_tokens or {alias}, not both")
            parameters["max_tokens"] = body[alias]
    parameters.setdefault("max_tokens", default_tokens)
    parameters.setdefault("temperature", 1.0)
    if parameters.get("top_k", 0) == -1:  # vLLM's "off"
        parameters["top_k"] = 0
    parameters.setdefault("top_k", 0)
    return parameters


def _needs_text(model: GenerationServable) -> Any:
    if model.text is None:
        raise InvalidInput(
            f"model {model.name!r} has no tokenizer, and OpenAI's answers are text: use "
            f"/v2/models/{model.name}/generate with input_ids"
        )
    return model.text


def _eos(model: GenerationServable) -> tuple[int, ...]:
    return tuple(model.model.eos_token_ids)


def _body(raw: bytes, known: frozenset[str] | set[str]) -> dict[str, Any]:
    body = json_object(raw)
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}; this server takes {sorted(known)}")
    for key, allowed in HARMLESS.items():
        if key in body and body[key] not in allowed:
            raise InvalidInput(f"{key}={body[key]!r} is not supported here")
    return body


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{key} must be true or false")
    return value


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidInput("stream_options takes include_usage only")
    return bool(options.get("include_usage", False))


def _usage(stream: GenerationStream) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens prefix reuse copied."""
    prompt, completion = len(stream.prompt), len(stream.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stream.reused_tokens},
    }


def _error_body(message: str, status: int) -> dict[str, Any]:
    kinds = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
    kind = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
