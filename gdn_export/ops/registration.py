"""Defines a ``t2n_extra`` torch custom op once, or reuses one another package defined with the same schema."""

from __future__ import annotations

from typing import Callable

import torch

from gdn_export.errors import GdnExportError


def _existing_schema(qualname: str) -> str | None:
    namespace, name = qualname.split("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    return str(packet.default._schema)


def _signature(schema: str) -> str:
    """The types of a schema, without argument names: ``(Tensor, Tensor) -> (Tensor, Tensor)``."""
    args, _, returns = schema.partition("->")
    args = args[args.index("(") + 1 : args.rindex(")")]
    types = [arg.strip().rsplit(" ", 1)[0] for arg in args.split(",") if arg.strip()]
    return f"({', '.join(types)}) -> {returns.strip()}"


def define_or_reuse(qualname: str, schema: str, kernel: Callable, fake: Callable) -> None:
    """Register ``qualname`` with a CompositeExplicitAutograd kernel and a fake kernel.

    When another package already defined the op, keep its definition if its signature matches ours
    (it computes the same contract) and refuse otherwise: two meanings under one name would make an
    export silently depend on import order.
    """
    existing = _existing_schema(qualname)
    if existing is not None:
        if _signature(existing) != _signature(schema):
            raise GdnExportError(
                f"{qualname} is already defined by another package with signature "
                f"{_signature(existing)}; gdn_export needs {_signature(schema)}"
            )
        return
    library = torch.library.Library(qualname.split("::")[0], "FRAGMENT")
    name = qualname.split("::")[1]
    library.define(name + schema)
    library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    _LIBRARIES.append(library)


# Library objects unregister their ops when garbage collected: keep them alive for the process.
_LIBRARIES: list[torch.library.Library] = []
