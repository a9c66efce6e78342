"""Chat messages into a prompt, through the model's own chat template.

The template is the Jinja text a Hugging Face tokenizer carries: ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates: ``default`` is used), or a
``chat_template.jinja`` file beside it. It is rendered in Jinja's immutable sandbox, as
transformers' ``apply_chat_template`` renders it (with ``break`` and ``continue`` in loops and
``strftime_now``): template code can read what it is given but call nothing unsafe, and a
template that refuses a conversation (``raise_exception``, e.g. roles that do not alternate)
refuses the request with its own message.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cuvil_sidecar.errors import InvalidInput

TEMPLATE_FILE = "chat_template.jinja"
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_template(folder: Path) -> str | None:
    """The tokenizer's chat template in ``folder``; None when it has none."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    found = _tokenizer_config(folder).get("chat_template")
    if isinstance(found, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def special_tokens(folder: Path) -> dict[str, str]:
    """``bos_token`` and ``eos_token`` as ``tokenizer_config.json`` names them (templates put
    them into the text)."""
    config = _tokenizer_config(folder)
    tokens = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def read_messages(value: Any) -> list[dict[str, str]]:
    """OpenAI's ``messages``: each a ``role`` and a ``content`` string (or a list of text
    parts, joined); anything else is refused naming the message."""
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages must be a non-empty list of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidInput(f"messages[{i}] needs a role, one of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(_text_part(part, i) for part in content)
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{i}].content must be a string or a list of text parts")
        messages.append({"role": message["role"], "content": content})
    return messages


def render_chat(
    template: str, messages: Sequence[Mapping[str, str]], tokens: Mapping[str, str]
) -> str:
    """The prompt text: the template over the messages, ending where the assistant's answer
    begins (``add_generation_prompt``)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidInput(f"the model's chat template refuses the messages: {message}")

    def strftime_now(format: str) -> str:  # Llama 3's templates date the system prompt
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        compiled = environment.from_string(template)
        return compiled.render(
            messages=list(messages), add_generation_prompt=True, tools=None, **tokens
        )
    except TemplateError as error:
        raise InvalidInput(f"the model's chat template failed: {error}") from None


def _text_part(part: Any, message: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    raise InvalidInput(f"messages[{message}].content: only text parts are taken here")


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` in ``folder``; empty when it is missing or not an object."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
