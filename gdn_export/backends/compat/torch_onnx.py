"""torch's TorchScript ONNX exporter passes as gdn_export observes them while it streams weights
(``gdn_export.backends.onnx.streamed.capture``): ``torch._C._jit_pass_onnx_eval_peephole``,
``_jit_pass_onnx_constant_fold`` and ``_jit_pass_onnx_deduplicate_initializers`` wrapped for one export
(tract_quirks.TORCH_ONNX_PASSES_HOOKED). Their wrappers hold that export's record: one export at a time
(``exclusive``). Written for torch 2.13 (``require``d)."""

from __future__ import annotations

from typing import Callable

from gdn_export.backends.compat import Patch, require

PASSES = ("_jit_pass_onnx_eval_peephole", "_jit_pass_onnx_constant_fold", "_jit_pass_onnx_deduplicate_initializers")


def onnx_pass_patches(eval_peephole: Callable, constant_fold: Callable, deduplicate: Callable) -> list[Patch]:
    """The three passes, each replaced by its factory's wrapper of the original."""
    import torch

    require("torch")
    return [Patch(torch._C, name, make, quirk="TORCH_ONNX_PASSES_HOOKED", exclusive=True)
            for name, make in zip(PASSES, (eval_peephole, constant_fold, deduplicate))]
