"""Model chat templates rendered the way Hugging Face and vLLM render them.

A chat template is Jinja code shipped with the model; it is untrusted input, so it runs
in jinja2's immutable sandbox. The environment mirrors ``transformers``'
``_compile_jinja_template``: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII characters, and the globals
``raise_exception`` and ``strftime_now``; ``{% generation %}`` blocks render their body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcore.tokenize.base import ChatTemplateError, TokenizerError

Renderer = Callable[[Mapping[str, Any]], str]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant text with it."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a plain set

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> Renderer:
    """Compile ``source`` once; the result renders one set of template variables."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc
    # What ``template.render`` does, minus its per-call copies: the globals (a ChainMap,
    # iterated in Python by every render and again by the context) as one dict, merged
    # with the variables into a context that uses that dict as it is.
    template.globals = dict(template.globals)
    base = template.globals

    def render(variables: Mapping[str, Any]) -> str:
        try:
            context = template.new_context({**base, **variables}, shared=True)
            return "".join(template.root_render_func(context))
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    return render
