"""Model chat templates rendered the way Hugging Face and vLLM render them.

A chat template is Jinja code shipped with the model; it is untrusted input, so it runs
in jinja2's immutable sandbox. The environment mirrors ``transformers``'
``_compile_jinja_template``: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII characters, and the globals
``raise_exception`` and ``strftime_now``; ``{% generation %}`` blocks render their body.

Most templates only paste each message's content into the output (ChatML and its kin:
``'<|im_start|>' + message['role'] + '\n' + message['content'] + ...``). For such a
template the text is the render of the conversation's *shape* (its roles and the other
variables) with every content cut out, and the contents pasted back in: the shape is
rendered once, with a marker for each content, and a later conversation of the same
shape costs one join instead of a render that copies a long system prompt several
times. Which templates qualify is decided from the template's syntax tree
(:func:`pastes_contents_only`), never by trying: a template that looks at a content in
any other way than whether it is empty (a filter, a comparison, a variable holding it)
is rendered whole.
"""

from __future__ import annotations

import json
import re
import secrets
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
        pastes_only = pastes_contents_only(env.parse(source))
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc
    # What ``template.render`` does, minus its per-call copies: the globals (a ChainMap,
    # iterated in Python by every render and again by the context) as one dict, merged
    # with the variables into a context that uses that dict as it is.
    template.globals = dict(template.globals)
    base = template.globals

    def render_whole(variables: Mapping[str, Any]) -> str:
        try:
            context = template.new_context({**base, **variables}, shared=True)
            return "".join(template.root_render_func(context))
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    if not pastes_only:
        return render_whole
    return _Shapes(render_whole).render


_SHAPES = 1024  # conversation shapes remembered per template (then forgotten all at once)


class _Shapes:
    """Renders of a content-pasting template by conversation shape: the text between the
    pasted contents, and which content goes in each gap."""

    def __init__(self, render_whole: Renderer) -> None:
        self._render_whole = render_whole
        token = secrets.token_hex(8)  # nothing in a template or a role can spell it
        self._marker = "\x00" + token + ":{}\x00"
        self._split = re.compile("\x00" + token + r":(\d+)\x00").split
        self._shapes: dict[tuple[Any, ...], tuple[list[str], list[int]] | None] = {}

    def render(self, variables: Mapping[str, Any]) -> str:
        shape = _shape(variables)
        if shape is None:
            return self._render_whole(variables)
        cut = self._shapes.get(shape)
        if cut is None:
            if shape in self._shapes:  # its render fails: the whole render says why
                return self._render_whole(variables)
            cut = self._cut(variables, shape)
        texts, pasted = cut
        contents = [message["content"] for message in variables["messages"]]
        parts = [texts[0]]
        for index, text in zip(pasted, texts[1:], strict=True):
            parts.append(contents[index])
            parts.append(text)
        return "".join(parts)

    def _cut(
        self, variables: Mapping[str, Any], shape: tuple[Any, ...]
    ) -> tuple[list[str], list[int]]:
        marked = [  # an empty content stays empty: a template may test for it
            {
                "role": message["role"],
                "content": self._marker.format(index) if message["content"] else "",
            }
            for index, message in enumerate(variables["messages"])
        ]
        if len(self._shapes) >= _SHAPES:
            self._shapes.clear()
        try:
            text = self._render_whole({**variables, "messages": marked})
        except ChatTemplateError:
            self._shapes[shape] = None
            raise
        pieces = self._split(text)
        cut = (pieces[0::2], [int(index) for index in pieces[1::2]])
        self._shapes[shape] = cut
        return cut


def _shape(variables: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a content-pasting template can see of ``variables`` besides the contents:
    each message's role and whether its content is empty, and every other variable.
    ``None`` unless every message is exactly ``{"role": str, "content": str}`` and every
    other variable is hashable and no list (tools, documents: rendered whole)."""
    messages = variables.get("messages")
    if type(messages) is not list:
        return None
    roles = []
    for message in messages:
        if type(message) is not dict or len(message) != 2:
            return None
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or type(content) is not str or "\x00" in role:
            return None
        roles.append((role, content == ""))
    others = []
    for name, value in variables.items():
        if name != "messages":
            if value is not None and type(value) not in (str, bool, int):
                return None
            others.append((name, value))
    return (tuple(roles), tuple(others))


# -- which templates only paste contents -------------------------------------------------

_CLEAN, _MESSAGES, _CONTENT = 0, 1, 2  # what an expression may hold
_LOOP_SCALARS = {"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth",
                 "depth0"}  # fmt: skip
_FIELDS = {"role", "name", "tool_calls", "tool_call_id", "type"}  # a message's, content aside
_CALLABLE = {"raise_exception", "namespace", "range"}
_SCALAR_FILTERS = {"length", "count"}  # of a list of messages: only how many
# what a test can tell of a message or a content that its shape decides (a shape's
# messages are dicts, its contents strings)
_SHAPE_TESTS = {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"}


_LIST = "<messages>"  # in the names held: ``messages`` is never rebound (no name has "<")


class _Opaque(Exception):
    """The template uses a content (or something holding one) in a way not pasted."""


def pastes_contents_only(tree: nodes.Template) -> bool:
    """Whether the template's output is its render with each message's content cut out
    and pasted back: it reads a content only as ``message['content']`` or
    ``message.content``, and uses that only as a term of a ``+``/``~`` chain that is
    output or as a condition (whether it is empty), and reads nothing else of the
    messages but their roles (and fields a ``{"role", "content"}`` message lacks), how
    many they are, and which is which (``messages[i]``, ``i`` computed too while
    ``messages`` is never rebound).

    Names bound to the messages (``messages``, loop targets over them, ``set`` copies,
    ``loop``) are tracked without regard to scope, which can only reject more. Macros,
    call and filter blocks, ``set`` blocks, includes and imports, calls other than
    ``raise_exception``, ``namespace`` and ``range``, and every other use of a content
    or of a message make the answer ``False``, but for the tests a shape decides (``is
    defined``, ``is string``...)."""
    holding = {"messages", "loop"}
    targets: list[nodes.Node] = [node.target for node in tree.find_all(nodes.Assign)]
    targets += [node.target for node in tree.find_all(nodes.For)]
    if not any(name.name == "messages" for t in targets for name in _names(t)):
        holding.add(_LIST)
    try:
        while True:  # until no more names are found bound to messages
            before = len(holding)
            for node in tree.find_all((nodes.Assign, nodes.For)):
                assert isinstance(node, nodes.Assign | nodes.For)
                value = node.node if isinstance(node, nodes.Assign) else node.iter
                if _kind(value, holding) == _CLEAN:
                    continue
                if isinstance(node.target, nodes.NSRef):
                    raise _Opaque  # a namespace attribute holding messages
                holding.update(name.name for name in _names(node.target))
            if len(holding) == before:
                break
        _check(tree.body, holding)
    except _Opaque:
        return False
    return True


def _names(target: nodes.Node) -> list[nodes.Name]:
    return [target] if isinstance(target, nodes.Name) else list(target.find_all(nodes.Name))


def _check(body: list[nodes.Node], holding: set[str]) -> None:
    for node in body:
        if isinstance(node, nodes.Output):
            for child in node.nodes:
                if not isinstance(child, nodes.TemplateData):
                    _pasted(child, holding)
        elif isinstance(node, nodes.For):
            if node.recursive or _kind(node.iter, holding) == _CONTENT:
                raise _Opaque
            if node.test is not None:
                _truth(node.test, holding)
            _check(node.body, holding)
            _check(node.else_, holding)
        elif isinstance(node, nodes.If):
            _truth(node.test, holding)
            _check(node.body, holding)
            for branch in node.elif_:
                _check([branch], holding)
            _check(node.else_, holding)
        elif isinstance(node, nodes.Assign):
            if _kind(node.node, holding) == _CONTENT:
                raise _Opaque
        elif isinstance(node, nodes.Scope):  # {% generation %}
            _check(node.body, holding)
        elif not isinstance(node, (nodes.Break, nodes.Continue)):
            raise _Opaque


def _pasted(node: nodes.Expr, holding: set[str]) -> None:
    """An output expression: contents only as terms of a ``+``/``~`` chain."""
    if isinstance(node, nodes.Add):
        _pasted(node.left, holding)
        _pasted(node.right, holding)
    elif isinstance(node, nodes.Concat):
        for term in node.nodes:
            _pasted(term, holding)
    elif isinstance(node, nodes.CondExpr):
        _truth(node.test, holding)
        _pasted(node.expr1, holding)
        if node.expr2 is not None:
            _pasted(node.expr2, holding)
    elif _kind(node, holding) == _MESSAGES:
        raise _Opaque


def _truth(node: nodes.Node, holding: set[str]) -> None:
    """A condition: a content may be tested for being empty (``{% if message.content
    %}``), which the shape decides (it says which contents are empty)."""
    if isinstance(node, nodes.And | nodes.Or):
        _truth(node.left, holding)
        _truth(node.right, holding)
    elif isinstance(node, nodes.Not):
        _truth(node.node, holding)
    else:
        _kind(node, holding)  # whatever it holds: only its truth is read


def _clean(node: nodes.Node, holding: set[str]) -> None:
    if _kind(node, holding) != _CLEAN:
        raise _Opaque


def _kind(node: nodes.Node, holding: set[str]) -> int:
    """What ``node`` may hold; :class:`_Opaque` where it would read a content (or a
    message) other than by pasting."""
    if isinstance(node, nodes.Const | nodes.TemplateData):
        return _CLEAN
    if isinstance(node, nodes.Name):
        return _MESSAGES if node.name in holding else _CLEAN
    if isinstance(node, nodes.Getattr):
        return _member(node.node, node.attr, holding)
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
            return _member(node.node, arg.value, holding)
        base = _kind(node.node, holding)
        if base == _CONTENT:
            raise _Opaque
        if base == _MESSAGES and not _is_position(node.node, arg, holding):
            raise _Opaque  # a computed key might be "content"
        _clean(arg, holding)
        return base
    if isinstance(node, nodes.Filter):
        if node.node is None:
            raise _Opaque
        _clean_arguments(node, holding)
        kind = _kind(node.node, holding)
        if kind == _CLEAN or (kind == _MESSAGES and node.name in _SCALAR_FILTERS):
            return _CLEAN
        raise _Opaque
    if isinstance(node, nodes.Call):
        if not (isinstance(node.node, nodes.Name) and node.node.name in _CALLABLE):
            raise _Opaque
        if node.node.name in holding:
            raise _Opaque
        _clean_arguments(node, holding)
        return _CLEAN
    if isinstance(node, nodes.Test) and node.name in _SHAPE_TESTS and not node.args:
        _kind(node.node, holding)
        return _CLEAN
    if isinstance(node, nodes.Compare):
        _clean(node.expr, holding)
        for operand in node.ops:
            _clean(operand.expr, holding)
        return _CLEAN
    if isinstance(node, nodes.Test | nodes.BinExpr | nodes.UnaryExpr | nodes.CondExpr
                  | nodes.Concat | nodes.Slice | nodes.Tuple | nodes.List | nodes.Dict
                  | nodes.Pair | nodes.Keyword):  # fmt: skip
        for child in node.iter_child_nodes():
            _clean(child, holding)
        return _CLEAN
    raise _Opaque


def _member(base: nodes.Node, name: str, holding: set[str]) -> int:
    """``base.name`` or ``base["name"]``."""
    kind = _kind(base, holding)
    if kind == _CONTENT:
        raise _Opaque  # a content's method or character
    if kind == _CLEAN:
        return _CLEAN
    is_loop = isinstance(base, nodes.Name) and base.name == "loop"
    if name == "content" and not is_loop:
        return _CONTENT
    if name in _FIELDS or (is_loop and name in _LOOP_SCALARS):
        return _CLEAN
    return _MESSAGES  # loop.previtem, a list's method...: still the messages


def _is_position(base: nodes.Node, node: nodes.Node, holding: set[str]) -> bool:
    """An index or a slice: which message, not which field. Computed, only of
    ``messages`` itself (``messages[loop.index0 - 1]``), never rebound to a message."""
    if isinstance(node, nodes.Const):
        return type(node.value) is int
    if isinstance(node, nodes.Slice):
        return all(_kind(part, holding) == _CLEAN for part in node.iter_child_nodes())
    is_list = isinstance(base, nodes.Name) and base.name == "messages" and _LIST in holding
    return is_list and _kind(node, holding) == _CLEAN


def _clean_arguments(node: nodes.Filter | nodes.Call, holding: set[str]) -> None:
    for argument in [*node.args, *(keyword.value for keyword in node.kwargs)]:
        _clean(argument, holding)
    if node.dyn_args is not None or node.dyn_kwargs is not None:
        raise _Opaque
