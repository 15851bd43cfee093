"""Chat templates that only paste contents render by conversation shape, exactly as whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import jinja2
import jinja2.ext
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bench.micro.model_files import CHATML_TEMPLATE
from kvcore.tokenize import ChatTemplateError
from kvcore.tokenize.chat_template import _Shapes, compile_chat_template, pastes_contents_only

PASTING = {
    "chatml": CHATML_TEMPLATE,
    "system first, by position": (
        "{% if messages[0]['role'] == 'system' %}[S]{{ messages[0]['content'] }}"
        "{% set rest = messages[1:] %}{% else %}[S]default{% set rest = messages %}{% endif %}"
        "{% for m in rest %}{{ '<' ~ m.role ~ '>' ~ m.content ~ '</' ~ m.role ~ '>' }}"
        "{% if not loop.last %}|{% endif %}{% endfor %}{{ messages | length }}"
    ),
    "neighbours and conditions": (
        "{% set ns = namespace(users=0) %}{% for m in messages if m.role != 'tool' %}"
        "{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}"
        "{{ m.content if m.role == 'user' else '(' + m.content + ')' }}"
        "{% if loop.nextitem is defined %}{{ '>' + loop.nextitem['content'] }}{% endif %}"
        "{% endfor %}#{{ ns.users }}{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    ),
    "empty contents and neighbours by computed position": (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<tools>"
        "{% endif %}{{ '[' + m.content + ']' }}{% elif m.content %}"
        "{{ '<' + m.role + '>' + m.content }}{% elif not m.content and m.role == 'user' %}"
        "<empty>{% else %}<{{ m.role }}/>{% endif %}{% endfor %}"
        "{{ 'end' if messages[-1].content else 'END' }}"
    ),
}

NOT_PASTING = {
    "a filter on a content": "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
    "a content in a variable": "{% set first = messages[0]['content'] %}{{ first }}",
    "a content's method": "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",
    "a content compared": "{% for m in messages %}{{ 'x' in m.content }}{% endfor %}",
    "the messages as JSON": "{{ messages | tojson }}",
    "contents joined": "{{ messages | map(attribute='content') | join('\\n') }}",
    "a computed key": "{% set k = 'content' %}{% for m in messages %}{{ m[k] }}{% endfor %}",
    "a message's method": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "a content by loop.previtem, tested": "{% for m in messages %}"
    "{% if loop.previtem and loop.previtem.content == 'x' %}!{% endif %}{% endfor %}",
    "a macro": "{% macro t(m) %}{{ m.content }}{% endmacro %}"
    "{% for m in messages %}{{ t(m) }}{% endfor %}",
    "the date": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "a set block": "{% set text %}{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% endset %}{{ text | trim }}",
    "a content repeated by a number": "{% for m in messages %}{{ m.content * 2 }}{% endfor %}",
    "characters of a content": "{% for m in messages %}{% for c in m.content %}{{ c }}"
    "{% endfor %}{% endfor %}",
    "the messages in a namespace": "{% set ns = namespace(m=none) %}{% set ns.m = messages %}"
    "{{ ns.m[0].content | upper }}",
    "a computed key once messages is a message": "{% set messages = messages[0] %}"
    "{% set k = 'content' %}{{ messages[k] | upper }}",
    "a content compared in a condition": "{% for m in messages %}"
    "{% if m.content == 'x' %}!{% endif %}{% endfor %}",
}


def _tree(source: str) -> jinja2.nodes.Template:
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    return env.parse(source)


def _whole(source: str, variables: dict[str, Any]) -> str:
    """The reference: jinja2's own render in the environment transformers sets up."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def fail(message: str) -> None:
        raise ChatTemplateError(message)

    env.globals["raise_exception"] = fail
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)  # as HF's
    return env.from_string(source).render(**variables)


@pytest.mark.parametrize("name", PASTING)
def test_templates_that_only_paste_contents_are_recognised(name: str) -> None:
    """Recognised, and compiled to the renderer by shape (a whole render each time
    would give the same text, at the cost this path avoids)."""
    assert pastes_contents_only(_tree(PASTING[name]))
    assert isinstance(getattr(compile_chat_template(PASTING[name]), "__self__", None), _Shapes)


@pytest.mark.parametrize("name", NOT_PASTING)
def test_templates_that_read_a_content_otherwise_are_rendered_whole(name: str) -> None:
    source = NOT_PASTING[name]
    assert not pastes_contents_only(_tree(source))
    assert not isinstance(getattr(compile_chat_template(source), "__self__", None), _Shapes)
    messages = [{"role": "user", "content": "  x  "}, {"role": "user", "content": "y"}]
    variables = {"messages": messages, "add_generation_prompt": True, "tools": None}
    render = compile_chat_template(source)
    if name != "the date":  # (jinja2's own environment lacks strftime_now)
        assert render(variables) == render(variables) == _whole(source, variables)


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
PIECES = ["a", " ", "\n", "\x00", ":0", "é", "<", "{{ x }}", "\x000123456789abcdef:0\x00"]
CONTENTS = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": CONTENTS}), max_size=5)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(PASTING)),
    conversations=st.lists(MESSAGES, min_size=1, max_size=4),
    generation=st.booleans(),
)
def test_a_pasting_template_renders_each_conversation_as_jinja2_does(
    name: str, conversations: list[list[dict[str, str]]], generation: bool
) -> None:
    """Shapes seen before and new ones, contents that look like markers or template code,
    roles the template refuses: every render equals jinja2's render of the whole
    conversation, or fails as it fails."""
    source = PASTING[name]
    render = compile_chat_template(source)
    for messages in [*conversations, *conversations]:
        variables = {"messages": messages, "add_generation_prompt": generation}
        variables |= {"bos_token": "<s>", "tools": None}
        assert _outcome(render, variables) == _outcome(partial(_whole, source), variables)


def _outcome(render: Callable[[dict[str, Any]], str], variables: dict[str, Any]) -> str:
    try:
        return "text: " + render(variables)
    except ChatTemplateError as exc:
        return f"refused: {exc}"
    except (jinja2.TemplateError, TypeError) as exc:  # the reference's: kvroute says more
        return f"refused: chat template failed: {exc}"


def test_a_shape_the_template_refuses_is_refused_every_time() -> None:
    render = compile_chat_template(CHATML_TEMPLATE)
    wizard = {"messages": [{"role": "wizard", "content": "x"}], "add_generation_prompt": True}
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="unknown role wizard"):
            render(wizard)


def test_conversations_of_other_shapes_render_whole() -> None:
    """A message with more than a role and a text content, or a role with a NUL: the
    template sees more than the shape, so the whole render runs (and fails as jinja2's
    render fails: ChatML pastes a list of parts as it would a text)."""
    render = compile_chat_template(CHATML_TEMPLATE)
    cases = [
        [{"role": "user", "content": "x", "name": "ann"}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        [{"role": "user\x00", "content": "x"}],
    ]
    for messages in cases:
        variables = {"messages": messages, "add_generation_prompt": False}
        assert _outcome(render, variables) == _outcome(partial(_whole, CHATML_TEMPLATE), variables)
