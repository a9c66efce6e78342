"""Chat templates: where they are found, how they render (transformers' extras, the sandbox),
and how messages are read."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from cuvil_sidecar.errors import InvalidInput
from cuvil_sidecar.generation.chat import chat_template, read_messages, render_chat, special_tokens

USER = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


def test_the_template_is_found_as_a_file_a_string_or_the_default_of_named_ones(
    tmp_path: Path,
) -> None:
    assert chat_template(tmp_path) is None
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    config |= {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_template(tmp_path) == "D"
    assert special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("F")
    assert chat_template(tmp_path) == "F"


def test_templates_render_with_loop_controls_and_the_date() -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ bos_token }}{{ m['content'] }}{% endfor %}|{{ strftime_now('%Y') }}"
    )
    year = datetime.datetime.now().strftime("%Y")
    assert render_chat(template, USER, {"bos_token": "<s>"}) == f"<s>a|{year}"


def test_the_sandbox_and_the_templates_own_refusal_are_bad_requests() -> None:
    with pytest.raises(InvalidInput, match="unsafe"):
        render_chat("{{ ''.__class__.__mro__ }}", USER, {})
    with pytest.raises(InvalidInput, match="refuses the messages: no"):
        render_chat("{{ raise_exception('no') }}", USER, {})


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\] needs a role"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
    ],
)
def test_messages_that_are_not_text_chat_are_refused(messages: list, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        read_messages(messages)


def test_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert read_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "ab"}
    ]
