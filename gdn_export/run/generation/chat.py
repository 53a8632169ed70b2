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
import json
from datetime import datetime

from gdn_export.errors import GdnExportError


class ChatTemplateError(GdnExportError):
    """The messages are not what a chat takes, or the template refused them (``raise_exception``)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
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
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names: {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
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
    try:
        return compiled.render(messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                               tools=None, documents=None, **data)
    except jinja2.exceptions.SecurityError as err:
        raise ChatTemplateError(f"the chat template did something its sandbox refuses: {err}") from None
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a template reading what the messages lack
        raise ChatTemplateError(f"the chat template could not render these messages: {err}") from None
