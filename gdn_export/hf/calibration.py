"""The importance of each linear layer's input channels, measured on calibration text (``--calibration``).

llama-imatrix's measure: the mean of each input channel's squared activation over the text's tokens, for every
``nn.Linear`` of the checkpoint's float32 model (transformers'). The output error of a layer whose weights are
perturbed by ``dW`` is ``dW @ a``; its expected square is ``sum_j dW_j^2 E[a_j^2]`` plus cross-channel terms, so
``E[a_j^2]`` is the weight the Q4_0 search gives the error of every weight of input channel ``j``
(``gdn_export.weights.q4_0.searched_scales``).

The text is read in windows of ``ctx`` tokens (at most ``max_tokens`` in all, whole windows), run as one batch
through transformers' model one decoder layer in memory at a time (``gdn_export.hf.layerwise.layerwise_call``):
memory is one layer's weights plus the batch's activations. The head's input is the base model's last hidden
state, so the head's logits are never computed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gdn_export.errors import GdnExportError

DEFAULT_TOKENS = 8192
DEFAULT_CTX = 512  # llama-imatrix's default context


class CalibrationError(GdnExportError):
    """Calibration text that cannot be used: missing, empty, or no tokenizer to read it with."""


@dataclass
class Calibration:
    """What was measured: ``importance`` maps a checkpoint weight's name to the mean squared activation of each of
    its input channels (float32, one per column)."""

    file: str
    sha256: str
    tokens: int
    ctx: int
    importance: dict[str, np.ndarray] = field(default_factory=dict)
    # a norm's weight name -> the linear layers' weight names that read its output tensor itself (not a copy or a
    # reshape of it), and how a scale of its weight scales its output ("scale": w / s divides the output by s;
    # "one_plus": the output is normed * (1 + w), so (1 + w) / s - 1 does): what gdn_export.hf.folding may fold
    readers: dict[str, list[str]] = field(default_factory=dict)
    forms: dict[str, str] = field(default_factory=dict)
    sample: np.ndarray | None = None  # [1, S] of the first tokens: what a fold is verified on
    max_tokens: int | None = None  # the bound it was read with (the digest covers the bytes that bound reads)
    grams: dict[str, np.ndarray] = field(default_factory=dict)  # with grams=True: E[a a^T] of each linear's input

    def __str__(self) -> str:
        return f"calibrated on {self.file} ({self.tokens} tokens in windows of {self.ctx})"

    def metadata(self) -> dict:
        recorded = {"file": self.file, "sha256": self.sha256, "tokens": self.tokens, "ctx": self.ctx,
                    "weights": len(self.importance)}
        if self.max_tokens is not None and self.max_tokens != self.tokens:  # else "tokens" says it (the default)
            recorded["max_tokens"] = self.max_tokens
        return recorded


def calibration_tokens(text_file: str | os.PathLike, checkpoint_dir: str | os.PathLike, max_tokens: int,
                       ctx: int) -> tuple[np.ndarray, str]:
    """``([windows, ctx] token ids, sha256 of the bytes read)``: the first ``max_tokens`` tokens of the text (whole
    windows; a text shorter than one window is one shorter window), read with the checkpoint's tokenizer.json."""
    if max_tokens < 1 or ctx < 2:
        raise CalibrationError(f"calibration needs at least 1 token and windows of at least 2 (got {max_tokens} "
                               f"tokens, windows of {ctx})")
    path = Path(text_file)
    if not path.is_file():
        raise CalibrationError(f"calibration text {path} is not a file")
    tokenizer_file = Path(checkpoint_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CalibrationError(f"--calibration reads the text with the checkpoint's tokenizer.json, which "
                               f"{checkpoint_dir} does not have")
    from tokenizers import Tokenizer

    with path.open("rb") as file:  # bounded: ample bytes for max_tokens tokens, never the whole of a huge file
        data = file.read(max_tokens * 64)
    text = data.decode("utf-8", errors="replace")
    ids = np.asarray(Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids, np.int64)
    if len(ids) < 2:
        raise CalibrationError(f"calibration text {path} has {len(ids)} token(s): at least 2 are needed")
    ids = ids[:max_tokens]
    windows = len(ids) // ctx
    tokens = ids[:windows * ctx].reshape(windows, ctx) if windows else ids[None]
    return tokens, hashlib.sha256(data).hexdigest()


def calibrate(checkpoint_dir: str | os.PathLike, text_file: str | os.PathLike, family, layout, weights,
              max_tokens: int = DEFAULT_TOKENS, ctx: int = DEFAULT_CTX, grams: bool = False) -> Calibration:
    """The importance of every linear layer's input channels of the checkpoint's model on ``text_file``; with
    ``grams`` the second moments ``E[a a^T]`` of every linear layer's input too (GPTQ's; one float32 matrix of
    inner x inner per distinct input, shared by the layers that read the same tensor)."""
    from gdn_export.hf.checkpoint import empty_model
    from gdn_export.hf.layerwise import decoder_layers, layerwise_call

    tokens, digest = calibration_tokens(text_file, checkpoint_dir, max_tokens, ctx)
    model = empty_model(family, layout)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    moments: dict[str, torch.Tensor] = {}
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of an input -> (it, its sum of a a^T)

    def accumulate(name: str, activation: torch.Tensor) -> None:
        flat = activation.detach().float().reshape(-1, activation.shape[-1])
        sums[name] = sums.get(name, 0) + flat.square().sum(0, dtype=torch.float64)
        counts[name] = counts.get(name, 0) + len(flat)
        if grams:
            seen = shared.get(id(activation))
            if seen is None or seen[0] is not activation:
                seen = shared[id(activation)] = (activation, flat.T @ flat)
            moments[name] = seen[1] if name not in moments else moments[name] + seen[1]

    outputs: dict[int, tuple[str, torch.Tensor]] = {}  # id of a norm's output -> (its weight's name, the output)
    readers: dict[str, list[str]] = {}
    forms: dict[str, str] = {}

    def read(name: str, activation: torch.Tensor) -> None:
        accumulate(name, activation)
        norm = outputs.get(id(activation))
        if norm is not None and norm[1] is activation and name not in readers.setdefault(norm[0], []):
            readers[norm[0]].append(name)

    def normed(name: str, module: nn.Module, args, out) -> None:
        if isinstance(out, torch.Tensor):
            outputs[id(out)] = (name, out)
            if name not in forms:
                forms[name] = fold_form(module, args, out)

    hooks = [module.register_forward_pre_hook(lambda m, args, n=f"{name}.weight": read(n, args[0]))
             for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    hooks += [module.register_forward_hook(lambda m, args, out, n=f"{name}.weight": normed(n, m, args, out))
              for name, module in model.named_modules() if _is_norm(module)]
    def layer_done(*_) -> None:  # a layer's inputs and norm outputs are read by nothing after it
        outputs.clear()
        shared.clear()

    hooks += [layer.register_forward_hook(layer_done) for layer in decoder_layers(model)[1]]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((f"{name}.weight" for name, module in model.named_modules() if module is head), None)
    base = getattr(model, "base_model", model)

    def run(m: nn.Module) -> None:
        out = base(input_ids=torch.from_numpy(tokens), use_cache=False)
        if head_name is not None and base is not m:  # the head's input, without computing the logits
            read(head_name, out.last_hidden_state)
        outputs.clear()

    try:
        layerwise_call(model, weights, run)
    finally:
        for hook in hooks:
            hook.remove()
    importance = {name: (total / counts[name]).float().numpy() for name, total in sums.items()}
    return Calibration(Path(text_file).name, digest, int(tokens.size), int(tokens.shape[1]), importance,
                       readers={norm: names for norm, names in readers.items() if forms.get(norm)},
                       forms={norm: form for norm, form in forms.items() if form}, sample=tokens[:1, :64],
                       max_tokens=max_tokens, grams=_shared_means(moments, counts))


def _shared_means(moments: dict[str, torch.Tensor], counts: dict[str, int]) -> dict[str, np.ndarray]:
    """Each sum of ``a a^T`` divided by its count, one array per distinct sum (readers of one input share it)."""
    out, done = {}, {}
    for name, total in moments.items():
        key = id(total)
        if key not in done:
            done[key] = (total / counts[name]).numpy()
        out[name] = done[key]
    return out


def _is_norm(module: nn.Module) -> bool:
    """A normalization with a weight per channel (RMSNorm, LayerNorm and their kin, by class name)."""
    weight = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and isinstance(weight, nn.Parameter) and weight.dim() == 1


def fold_form(module: nn.Module, args, out: torch.Tensor) -> str | None:
    """How the norm's output follows its weight, found by running it again (``forward``, no hooks) with the weight
    doubled ("scale": the output doubles) or doubled plus one ("one_plus": normed * (1 + w)); None for neither."""
    weight = module.weight
    if out.shape[-1] != weight.shape[0]:
        return None
    saved = weight.data
    try:
        for form, trial in (("scale", 2 * saved), ("one_plus", 2 * saved + 1)):
            weight.data = trial
            again = module.forward(*args)
            if isinstance(again, torch.Tensor) and torch.allclose(again, 2 * out, rtol=1e-5,
                                                                  atol=1e-6 * float(out.abs().max()) + 1e-30):
                return form
    finally:
        weight.data = saved
    return None
