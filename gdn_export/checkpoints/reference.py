"""The checkpoint's own logits for ``gdn-export perplexity --reference``: the family's eager model in float32, for a
folder of any source (``gdn_export.checkpoints``)."""

from __future__ import annotations

import os
import sys
from typing import Callable

import numpy as np


def eager_window_logits(checkpoint_dir: str | os.PathLike) -> Callable[[np.ndarray], np.ndarray]:
    """``logits(window ids [S]) -> [S, vocab]``: the checkpoint's eager model (transformers', or the family's
    reference for FLA checkpoints), float32 on the CPU, each window from an empty cache."""
    # On the CPU transformers must take its PyTorch gated delta rule: it takes flash-linear-attention's whenever
    # that package imports, and those Triton kernels need a GPU (tract_quirks.TRANSFORMERS_FLA_KERNELS_WITHOUT_GPU).
    # A None entry makes `import fla` fail; this holds when transformers' model module is imported after it.
    sys.modules.setdefault("fla", None)  # type: ignore[assignment]
    import torch

    from gdn_export.checkpoints import open_checkpoint
    from gdn_export.hf.checkpoint import model_in_memory

    family, layout, _, weights = open_checkpoint(checkpoint_dir)
    model = model_in_memory(family, layout, weights).eval()

    def logits(window: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(np.asarray(window, np.int64)[None, :]), use_cache=False)
        return out.logits[0].float().numpy()

    return logits
