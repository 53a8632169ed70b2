"""Rendering a checkpoint's chat template as transformers' ``apply_chat_template`` does, and nothing more.

The template is untrusted text from the checkpoint: it is compiled in jinja2's ``ImmutableSandboxedEnvironment``
with transformers' settings (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its ``tojson`` filter that
does not escape HTML, ``raise_exception``, ``strftime_now``, a ``namespace`` refusing underscore names, the
``{% generation %}`` tag rendering its body) and sees only plain JSON data: the messages, ``add_generation_prompt``
and the tokenizer config's special tokens (``bos_token``, ``eos_token``, ...). The rendered text is then tokenized
without adding special tokens (transformers' ``apply_chat_template(tokenize=True)``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import sys
import time
from datetime import datetime

from gdn_export.errors import GdnExportError

# What one rendering may make and take (the template is the checkpoint's: untrusted). The output is a prompt, which the
# context bounds long before: 8 Mi characters is the request body's own bound (gdn_export.run.http). A template renders
# in milliseconds; 5 s leaves room on a loaded machine.
MAX_RENDERED_CHARS = 8 * 1024 * 1024
MAX_RENDER_SECONDS = 5.0
_WIDTH = re.compile(r"%[-#0 +]*(\d+)")


class ChatTemplateError(GdnExportError):
    """The messages are not what a chat takes, or the template refused them (``raise_exception``)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


class TemplateLimitError(ChatTemplateError):
    """The chat template made more text, or took more time, than a rendering may (``MAX_RENDERED_CHARS``,
    ``MAX_RENDER_SECONDS``): the archive's template is at fault, not the request."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None)


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"the chat template {what}: more than the {MAX_RENDERED_CHARS} characters a rendering "
                              "may make")


def _check_sizes(args, kwargs) -> None:
    """A call's integer arguments bounded: a width or count beyond the output bound (``'x'.ljust(10**9)``,
    ``center``, ``indent``) would make a string past it in one C call, which nothing could interrupt."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDERED_CHARS:
            raise _too_big(f"asked for a size of {value}")


def _size(value, limit: int = MAX_RENDERED_CHARS) -> int:
    """About how many characters ``str(value)`` makes (strings their length, containers their items' sizes and
    separators), counted only until it passes ``limit`` (a list of a million references to one long string is
    sized from its first items). What the growth checks below compare with the output bound."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            total += 2 + 2 * len(item)
            for key, child in item.items():
                stack.extend((key, child))
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        else:
            total += 24  # a number, None, a boolean (an int's digits are bounded by Python's own 4300-digit limit)
    return total


def _growth(kind: str, value, args, kwargs) -> int | None:
    """The most characters ``kind`` (a str method or a filter that can multiply its input) makes of ``value`` with
    these arguments; None for anything else (bounded by its input, or by ``_check_sizes``)."""
    if not isinstance(value, str):
        if kind == "join" and isinstance(value, (list, tuple)):
            sep = args[0] if args else kwargs.get("d", "")
            return _size(value) + len(str(sep)) * max(len(value) - 1, 0)
        return None
    if kind == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 else kwargs.get("count")
        hits = value.count(old) if old else len(value) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        return len(value) + hits * max(len(new) - len(old), 0)
    if kind in ("join",):  # sep.join(items)
        items = args[0] if args else ()
        if isinstance(items, (list, tuple)):
            return _size(list(items)) + len(value) * max(len(items) - 1, 0)
        return None
    if kind in ("format", "format_map"):
        fields = value.count("{") + value.count("%")
        widths = [int(w) for w in re.findall(r"\d+", value)]
        values = list(args) + list(kwargs.values())
        if widths and max(widths) > MAX_RENDERED_CHARS:
            return max(widths)
        return len(value) + fields * max((_size(v) for v in values), default=0)
    if kind == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(value) + width * (value.count("\n") + 1)
    if kind == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(value) + (size if isinstance(size, int) else 8) * value.count("\t")
    if kind == "wordwrap":
        wrap = kwargs.get("wrapstring") or (args[3] if len(args) > 3 else "\n")
        width = args[0] if args else kwargs.get("width", 79)
        return len(value) + len(str(wrap)) * (len(value) // max(width if isinstance(width, int) else 1, 1) + 1)
    return None


def _check_growth(kind: str, value, args, kwargs) -> None:
    grown = _growth(kind, value, args, kwargs)
    if grown is not None and grown > MAX_RENDERED_CHARS:
        raise _too_big(f"would make {grown} characters with {kind}")


def _bounded_binop(operator: str, left, right):
    """``left operator right`` for the operators that can make a huge value in one step (``*``, ``**``, ``%``,
    ``+``), refused when the result would pass the output bound."""
    sized = (str, list, tuple)
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(count, int) and not isinstance(count, bool) and count > 0 and (
                    len(seq) * count > MAX_RENDERED_CHARS or not isinstance(seq, str)
                    and _size(seq, MAX_RENDERED_CHARS // count) * count > MAX_RENDERED_CHARS):
                raise _too_big(f"repeats a value {count} times")
    elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
        if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > 4096:
            raise _too_big(f"raises {left} to the power {right}")
    elif operator == "%" and isinstance(left, str):
        widths = [int(w) for w in _WIDTH.findall(left)]
        _check_sizes(right if isinstance(right, tuple) else (right,), {})
        if widths and max(widths) > MAX_RENDERED_CHARS:
            raise _too_big(f"formats a field {max(widths)} characters wide")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        if len(left) + len(right) > MAX_RENDERED_CHARS or _size(left) + _size(right) > MAX_RENDERED_CHARS:
            raise _too_big("joins values")
    return {"*": lambda a, b: a * b, "**": lambda a, b: a ** b, "%": lambda a, b: a % b,
            "+": lambda a, b: a + b}[operator](left, right)


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    import jinja2
    import jinja2.compiler
    import jinja2.ext
    import jinja2.nodes
    import jinja2.runtime
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers tracks the assistant's tokens with it; here the
        body renders as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            if isinstance(value, (str, list, tuple, dict)) and _size(value) > MAX_RENDERED_CHARS:
                raise _too_big("grew a value")
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names: {name!r}")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the operators and calls that make a big value in one step checked first."""

        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, operator, left, right):
            return _bounded_binop(operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own spelling)
            _check_sizes(args, kwargs)
            method = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format in a function of its own
            owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
            if isinstance(owner, str):  # str.replace, str.join, str.format...: sized before the C call makes it
                if name == "join" and args and not isinstance(args[0], (list, tuple, str)):
                    args = (list(itertools.islice(args[0], MAX_RENDERED_CHARS + 1)), *args[1:])
                _check_growth(name, owner, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    def bounded(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                           jinja2.Environment))]
            _check_sizes(plain[1:], kwargs)  # the first is the value filtered
            if plain:
                value = plain[0]
                if name == "join" and not isinstance(value, (list, tuple, str)):  # a generator: sized as a list
                    value = list(itertools.islice(value, MAX_RENDERED_CHARS + 1))
                    args = tuple(value if a is plain[0] else a for a in args)
                _check_growth(name, value, plain[1:], kwargs)
                indent = kwargs.get("indent") or (plain[1] if name == "tojson" and len(plain) > 1 else 0)
                factor = 1 + (indent if isinstance(indent, int) and not isinstance(indent, bool) else 0)
                if name in ("string", "pprint", "tojson", "list") and _size(value) * factor > MAX_RENDERED_CHARS:
                    raise _too_big(f"would make more text with {name}")
            return function(*args, **kwargs)
        return call

    class BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
        """``a ~ b`` compiled to ``environment.bounded_concat``: ``str()`` of a list of long strings would make its
        text in one C call."""

        def visit_Concat(self, node, frame):
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    BoundedEnvironment.code_generator_class = BoundedCodeGenerator

    def bounded_concat(values) -> str:
        if sum(_size(v) for v in values) > MAX_RENDERED_CHARS:
            raise _too_big("joins values with ~")
        return "".join(map(str, values))

    def finalize(value):
        """What ``{{ value }}`` prints, sized before ``str()`` makes it."""
        if not isinstance(value, str) and _size(value) > MAX_RENDERED_CHARS:
            raise _too_big("prints a value")
        return value

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols],
                             finalize=finalize)
    env.bounded_concat = bounded_concat
    env.filters["tojson"] = tojson
    for name, function in list(env.filters.items()):
        wrapped = bounded(name, function)
        for marker in ("jinja_pass_arg",):  # pass_context / pass_environment markers stay on the wrapper
            if hasattr(function, marker):
                setattr(wrapped, marker, getattr(function, marker))
        env.filters[name] = wrapped
    env.globals.pop("lipsum", None)  # generates text by the paragraph: nothing a chat template needs
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as err:
        raise GdnExportError(f"the archive's chat template does not compile: {err}") from None


def _plain(value, where: str):
    """JSON data only (what a parsed request body holds): anything else is refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise ChatTemplateError(f"{where} holds a {type(value).__name__}, not JSON data")


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages as a template reads them: dicts with a string ``role``; ``content`` a string, or a
    list of text parts (joined with newlines, as vLLM does for templates that take a string); None-valued keys
    dropped (as transformers drops them)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object with role and content, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"{where}.role must be a string")
        message = {k: v for k, v in _plain(message, where).items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", "
                                            "\"text\": ...}) are supported")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"{where}.content must be a string or a list of text parts")
        out.append(message)
    return out


def render_chat(template: str, messages, *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs) -> str:
    """The prompt text ``template`` makes of ``messages`` (transformers' ``apply_chat_template(..., tokenize=False,
    add_generation_prompt=...)``)."""
    import jinja2

    compiled = compile_template(template)
    data = {**(special_tokens or {}), **_plain(kwargs, "the template's arguments")}
    messages = normalize_messages(messages)
    try:
        with _time_and_size_guard(MAX_RENDER_SECONDS):
            pieces, size = [], 0
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           tools=None, documents=None, **data):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise _too_big("rendered more text")
                pieces.append(piece)
            return "".join(pieces)
    except TemplateLimitError:
        raise
    except (MemoryError, RecursionError, OverflowError) as err:
        raise TemplateLimitError(f"the chat template failed: {type(err).__name__} {err}") from None
    except jinja2.exceptions.SecurityError as err:
        raise ChatTemplateError(f"the chat template did something its sandbox refuses: {err}") from None
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a template reading what the messages lack
        raise ChatTemplateError(f"the chat template could not render these messages: {err}") from None


class _time_and_size_guard:
    """While a template renders in this thread, every line it runs (and every line of jinja's runtime it calls)
    checks the clock, and every line of the template's own code checks the size of its variables: a template that
    loops for long or grows a value (``{% set s = s ~ s %}``) past ``MAX_RENDERED_CHARS`` is stopped within a line
    (a ``TemplateLimitError`` raised in it). Python's trace hook, this thread only, for the rendering only."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self):
        deadline, template_code = time.monotonic() + self.seconds, "<template>"

        def local(frame, event, arg):
            if event == "line":
                if time.monotonic() > deadline:
                    raise TemplateLimitError(f"the chat template ran longer than {self.seconds:g} s")
                if frame.f_code.co_filename == template_code:
                    for value in frame.f_locals.values():
                        if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDERED_CHARS:
                            raise _too_big("grew a value")
            return local

        self.previous = sys.gettrace()
        sys.settrace(lambda frame, event, arg: local)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.previous)
