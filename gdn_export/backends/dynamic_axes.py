"""What every back-end checks of an export's ``dynamic_axes`` before it traces: each names an input or an output and
one of its axes, and one symbol one traced length."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from gdn_export.errors import GdnExportError


def validate_dynamic_axes(dynamic_axes: dict | None, input_names: Sequence[str], args: Sequence,
                          output_names: Sequence[str] | None = None,
                          outputs: Callable[[], Sequence] | None = None) -> None:
    """Every dynamic axis names an input or an output (as ``torch.onnx.export`` and torch-to-nnef accept) and one
    of its axes, and one symbol never stands for two traced lengths (tract would fail deep in its loader, e.g. "T
    should be equal to 2*T"). ``outputs()`` gives the traced outputs, called only when an output is named."""
    seen: dict[str, tuple[str, int, int]] = {}  # symbol -> (input or output, axis, traced length)
    output_names = list(output_names or ())
    traced: list | None = None
    for name, axes in (dynamic_axes or {}).items():
        if name in input_names:
            arg, kind = args[list(input_names).index(name)], "input"
        elif name in output_names:
            if traced is None:
                traced = list(outputs()) if outputs is not None else []
            index = output_names.index(name)
            if index >= len(traced):
                raise GdnExportError(f"dynamic_axes names output {name!r} (output {index} of output_names), but the "
                                     f"module returns {len(traced)} output{'s' if len(traced) != 1 else ''}")
            arg, kind = traced[index], "output"
        else:
            outputs_named = ", ".join(output_names) if output_names else "none named: pass output_names"
            raise GdnExportError(f"dynamic_axes names {name!r}, which is neither an input ({', '.join(input_names)}) "
                                 f"nor an output ({outputs_named})")
        rank = arg.dim() if isinstance(arg, torch.Tensor) else 0
        for axis, symbol in axes.items():
            if not isinstance(axis, int) or not -rank <= axis < rank:
                raise GdnExportError(f"dynamic_axes[{name!r}]: axis {axis!r} does not exist on a rank-{rank} {kind}")
            length = int(arg.shape[axis])
            if symbol in seen and seen[symbol][2] != length:
                other, other_axis, other_length = seen[symbol]
                raise GdnExportError(
                    f"dynamic_axes: symbol {symbol!r} names axis {other_axis} of {other!r} (traced length {other_length}) "
                    f"and axis {axis} of {name!r} (traced length {length}); one symbol must have one length "
                    f"(name the other axis with its own symbol or an expression such as '2*{symbol}')")
            seen.setdefault(symbol, (name, axis, length))


def traced_outputs(module: torch.nn.Module, args: Sequence) -> Callable[[], list]:
    """The module's outputs on ``args`` (run once, on first call): what ``dynamic_axes`` naming an output is
    checked against."""

    @functools.cache
    def run() -> list:
        with torch.no_grad():
            out = module(*args)
        return [out] if isinstance(out, torch.Tensor) else list(out)

    return run


