"""A request body's JSON parsed within bounds: nesting depth limited, strings Unicode text.

``json.loads`` recurses once per nesting level (100,000 levels: a RecursionError), and Python's ``str`` takes lone
UTF-16 surrogates (``"\\ud800"``) that no tokenizer, template or UTF-8 encoder accepts. Both are refused here, naming
where in the body they are, before anything else reads it.
"""

from __future__ import annotations

import json
import re

# nesting a request needs: the body, messages, a message, its content parts, a part (OpenAI's deepest, tools'
# JSON schemas aside, which are refused anyway): 64 leaves room, far below Python's recursion limit
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestJsonError(ValueError):
    """A body that is not JSON within the bounds; ``param``: the top-level field at fault (None: the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_body(data: bytes | str, max_depth: int = MAX_DEPTH):
    """``data`` parsed as JSON, refused (RequestJsonError) unless valid, nested at most ``max_depth`` deep and made
    of Unicode text (no lone surrogate in a string or a key)."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestJsonError(f"the request body is nested too deeply (at most {max_depth} levels)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestJsonError(f"the request body is not valid JSON: {err}") from None
    # bytes json.loads took are UTF-8, which cannot hold a surrogate: only a \u escape can make one
    escapes = not isinstance(data, bytes) or b"\\u" in data
    if _deeper_than(value, max_depth) or escapes and _has_lone_surrogate(value):
        check_value(value, max_depth)  # the slower walk that names the place
    return value


def _has_lone_surrogate(value) -> bool:
    """Whether a string or key of the parsed ``value`` holds a lone surrogate: the whole value encoded to UTF-8 at C
    speed (a surrogate pair, as ``json.dumps`` escapes an emoji, was decoded to one character and encodes)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# a lone surrogate in parsed JSON comes only from a \uD800-\uDFFF escape (UTF-8 cannot encode one): a body without
# such an escape needs no walk over its strings (600,000 stop strings: 1.35 s of walking, holding the GIL)
_CONTAINERS = (dict, list)


def _deeper_than(value, max_depth: int) -> bool:
    """Whether ``value`` nests containers more than ``max_depth`` deep (containers only: strings are not visited)."""
    stack = [(value, 1)] if type(value) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if type(item) is dict else item
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def _where(path: list) -> str:
    """``messages[0].content``: the place, its keys' surrogates escaped, cut to 80 characters."""
    out = ""
    for key in path:
        key = key if isinstance(key, int) else str(key).encode("utf-8", "backslashreplace").decode()
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out if len(out) <= 80 else out[:77] + "..."


def _param(path: list) -> str | None:
    return _where(path[:1]) if path else None


def check_value(value, max_depth: int = MAX_DEPTH) -> None:
    """Every string (and key) of ``value`` Unicode text, its nesting at most ``max_depth``: a RequestJsonError
    naming the place otherwise. Iterative (nothing here recurses)."""
    stack = [(value, [], 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                bad = _SURROGATE.search(item).group()
                where = f"'{_where(path)}'" if path else "the request body"
                raise RequestJsonError(f"{where} holds a lone surrogate (U+{ord(bad):04X}), which is not Unicode "
                                       "text", _param(path))
            continue
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise RequestJsonError(f"the request body is nested more than {max_depth} levels deep (at "
                                       f"'{_where(path)}')", _param(path))
            if isinstance(item, dict):
                for key, child in item.items():
                    stack.append((key, path + [key], depth))
                    stack.append((child, path + [key], depth + 1))
            else:
                stack.extend((child, path + [i], depth + 1) for i, child in enumerate(item))
