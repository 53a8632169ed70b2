"""Exceptions raised by gdn_export, each naming what was wrong and what was expected."""

from __future__ import annotations


class GdnExportError(Exception):
    """Base class of every error gdn_export raises on purpose."""


def worded(err: GdnExportError, flags: str, usage: bool = True) -> GdnExportError:
    """``err`` (worded with the Python API's names) given its wording with the command line's flags, ``err.flags``:
    the rule is stated once (``pipeline.convert.plan_conversion``) and each caller says it in its own terms.
    ``usage``: a combination of options refused before any work (the CLI's exit status 2); False for a state of
    the world (an output that exists: exit status 1)."""
    err.flags = flags
    err.usage = usage
    return err


class OperandError(GdnExportError, ValueError):
    """An operand of a gated delta-rule node has the wrong rank, shape or dtype."""

    def __init__(self, operand: str, expected: str, actual: str) -> None:
        self.operand = operand
        self.expected = expected
        self.actual = actual
        super().__init__(f"operand '{operand}': expected {expected}, got {actual}")


class LoweringError(GdnExportError):
    """The requested lowering cannot be exact for this node on the target tract version."""


class ParityError(GdnExportError):
    """tract's outputs differ from torch's beyond tolerance."""

    def __init__(self, errors: dict[str, float], tolerance: dict[str, float], summary: str | None = None) -> None:
        self.errors = errors
        self.tolerance = tolerance
        lines = [
            f"  {name}: max abs error {err:.3e} (allowed {tolerance[name]:.3e})"
            + ("  <-- over" if not err <= tolerance[name] else "")
            for name, err in errors.items()
        ]
        over = [name for name, err in errors.items() if not err <= tolerance[name]]
        worst = max(over or list(errors), key=lambda n: errors[n] / max(tolerance[n], 1e-30))
        summary = summary or (f"tract outputs differ from the reference beyond tolerance: {worst} max abs error "
                   f"{errors[worst]:.3e} > {tolerance[worst]:.3e}" + (f" (+{len(over) - 1} more)" if len(over) > 1 else ""))
        super().__init__(summary + "\n" + "\n".join(lines))


class TractRuntimeError(GdnExportError):
    """tract could not load or run a model."""


# the extra that installs each optional package (pyproject.toml): the base install (numpy, tract) runs archives
EXTRA_OF = {"torch": "convert", "torch_to_nnef": "convert", "transformers": "convert", "onnx": "convert",
            "safetensors": "convert", "onnxruntime": "onnx", "onnxscript": "onnx", "tokenizers": "generate",
            "jinja2": "generate", "starlette": "serve", "uvicorn": "serve"}


class MissingExtraError(GdnExportError, ModuleNotFoundError):
    """A package of one of gdn_export's extras is not installed: says which, and the ``pip install`` that adds it."""

    def __init__(self, what: str, package: str) -> None:
        extra = EXTRA_OF[package]
        super().__init__(f"{what} needs {package}, which is not installed: pip install 'gdn_export[{extra}]'",
                         name=package)


def missing_extra(err: ImportError, what: str) -> MissingExtraError | None:
    """The ``MissingExtraError`` for ``err`` (an import that failed) when the missing module is one of an extra's
    packages (``torch``, ``torch.nn``, ...); None otherwise (a defect, not a missing package)."""
    package = (getattr(err, "name", None) or "").split(".")[0]
    return MissingExtraError(what, package) if isinstance(err, ModuleNotFoundError) and package in EXTRA_OF else None
