"""The Q4_0 format's entry (``gdn_export.weights.formats``): tract's Q4_0 blocks, each scale chosen by a rule
(``q4_rule``), optionally weighted by calibration text (``calibration``: measured by ``gdn_export.hf.calibration``,
which reads the checkpoint's tokenizer, so it lives with the checkpoints; docs/Q4_0.md)."""

from __future__ import annotations

from pathlib import Path

from gdn_export.errors import GdnExportError, worded
from gdn_export.weights.formats import OwnedOption, WeightFormat, register

DEFAULT_CALIBRATION_TOKENS = 8192
RULES = ("search", "nearest", "gptq")  # how blocks are chosen (codec.py's docstring); the first is the default


def _resolve(options: dict, calibration) -> None:
    q4_rule = options.get("q4_rule")
    if q4_rule is None:  # calibration's second moments make GPTQ possible: measured the better of the two with them
        q4_rule = options["q4_rule"] = "gptq" if calibration is not None else "search"
    if q4_rule not in RULES:
        raise GdnExportError(f"q4_rule {q4_rule!r} is not one of {', '.join(RULES)}")
    if calibration is not None and q4_rule == "nearest":
        raise worded(GdnExportError("calibration weights the Q4_0 scale search: it needs quantize='q4_0' and q4_rule "
                                    "'search' or 'gptq'"),
                     "--calibration weights the scale search; --q4-rule nearest does not search: drop one")
    if q4_rule == "gptq" and calibration is None:
        raise worded(GdnExportError("q4_rule='gptq' needs calibration text (the inputs' second moments): "
                                    "calibration=FILE"),
                     "--q4-rule gptq needs --calibration TEXT_FILE (the inputs' second moments)")
    if calibration is not None and not Path(calibration).is_file():
        raise GdnExportError(f"calibration text {calibration} is not a file")
    tokens = options.get("calibration_tokens", DEFAULT_CALIBRATION_TOKENS)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise worded(GdnExportError(f"calibration_tokens must be an integer >= 2, got {tokens!r}"),
                     f"--calibration-tokens must be >= 2, got {tokens!r}")
    if options.get("fold_scales") and calibration is None:
        raise worded(GdnExportError("fold_scales folds the per-channel scales calibration measures: it needs "
                                    "calibration=FILE"),
                     "--fold-scales folds the scales --calibration measures: add --calibration TEXT_FILE")


FORMAT = register(WeightFormat(
    name="q4_0",
    help="every linear layer's weight (inner size a multiple of 32) in tract's Q4_0",
    reference="Q4_0",
    onnx_refusal="tract's Q4_0 format; an ONNX export keeps float weights",
    options=(
        OwnedOption("q4_rule", None, "--q4-rule", dict(
            choices=list(RULES), help="how Q4_0 blocks are chosen: search (the default without --calibration: each "
            "scale of least squared error), gptq (the default with --calibration: GPTQ's error feedback across "
            "columns), nearest (llama.cpp's plain Q4_0, d = extreme / -8); docs/Q4_0.md")),
        OwnedOption("calibration", None, "--calibration", dict(
            metavar="TEXT_FILE", help="with --quantize q4_0: weigh each weight's error by its input channel's mean "
            "squared activation on this text (llama-imatrix's importance), read with the checkpoint's tokenizer")),
        OwnedOption("fold_scales", False, "--fold-scales", dict(
            action="store_true", help="with --calibration: fold per-channel scales into the norms (AWQ's "
            "transformation, exact in float; not measured better on the trained fixture; docs/Q4_0.md)")),
        OwnedOption("calibration_tokens", DEFAULT_CALIBRATION_TOKENS, "--calibration-tokens", dict(
            type=int, help="at most this many tokens of the calibration text, in windows of 512 (default "
            f"{DEFAULT_CALIBRATION_TOKENS})")),
    ),
    needs=("q4_rule, calibration, calibration_tokens and fold_scales choose how quantize='q4_0' stores its blocks: "
           "they need quantize='q4_0'",
           "--q4-rule, --calibration, --calibration-tokens and --fold-scales choose how --quantize q4_0 picks its "
           "scales: add --quantize q4_0"),
    calibration_options=lambda choice: {"grams": choice.q4_rule == "gptq"},  # GPTQ needs the inputs' second moments
    resolve=_resolve,
    metadata=lambda choice: {"q4_rule": choice.q4_rule},
    options_from_metadata=lambda metadata: dict(q4_rule=metadata.get("q4_rule") or "search",
                                                 fold_scales=metadata.get("folded_norms") is not None)))
