"""Published checkpoint layouts: which language model a config.json holds, and what its tensors are called.

Qwen3.5 and Qwen3.5-MoE are published as image-text models (``Qwen3_5ForConditionalGeneration``,
``model_type: "qwen3_5"``): the language model's config is ``text_config`` and its tensors are
``model.language_model.*`` beside a vision tower ``model.visual.*``; ``lm_head.*`` stays at the top. A wrapper
converts as its language model: the text config (with the wrapper's ``tie_word_embeddings``, which is the one
transformers applies to the published checkpoint), tensors renamed to the text model's names, the vision tower
left out and counted. Tensors that transformers itself ignores when it loads the family's model
(``_keys_to_ignore_on_load_unexpected``, e.g. multi-token-prediction ``mtp.*``) are skipped and counted too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gdn_export.hf.tensors import CheckpointError


@dataclass(frozen=True)
class Wrapper:
    """A multimodal wrapper around a language model: where its text config and tensors are."""

    architecture: str
    text_model_type: str
    text_prefix: str = "model.language_model."  # -> "model."
    dropped: tuple[tuple[str, str], ...] = (("model.visual.", "vision tower"),)


WRAPPERS = {
    "qwen3_5": Wrapper("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": Wrapper("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
    "qwen4_exp": Wrapper("Qwen4ExpForConditionalGeneration", "qwen4_exp_text"),
}


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's config and tensor names map onto the family's language model."""

    model_type: str  # the family's model_type (a wrapper's text model_type)
    config: dict  # the language model's config fields
    wrapper: str | None = None  # the wrapper's model_type, when the checkpoint is one
    text_prefix: str | None = None
    dropped: tuple[tuple[str, str], ...] = ()  # (name prefix, what it is), left out of the conversion
    ignored: tuple[str, ...] = ()  # regexes of names transformers ignores on load

    @property
    def checkpoint_model_type(self) -> str:
        """config.json's own model_type (the wrapper's, for a wrapper)."""
        return self.wrapper or self.model_type

    def model_name(self, name: str) -> str:
        """The text model's name for checkpoint tensor ``name`` (one not ``left_out``)."""
        if self.text_prefix is not None and name.startswith(self.text_prefix):
            return "model." + name[len(self.text_prefix):]
        return name

    def left_out(self, name: str) -> str | None:
        """Why tensor ``name`` is not converted ("vision tower", "ignored by transformers"), or None."""
        for prefix, what in self.dropped:
            if name.startswith(prefix):
                return what
        if any(re.search(pattern, name) for pattern in self.ignored):
            return "ignored by transformers on load"
        return None

    def with_ignored(self, patterns) -> "Layout":
        return replace(self, ignored=tuple(patterns or ()))


def resolve_layout(config: dict) -> Layout:
    """The layout of ``config`` (config.json's fields): a known wrapper's text model, or the config itself."""
    model_type = config["model_type"]
    wrapper = WRAPPERS.get(model_type)
    if wrapper is None:
        return Layout(model_type=model_type, config=config)
    text = config.get("text_config")
    if not isinstance(text, dict) or "model_type" not in text:
        raise CheckpointError(f"config.json is a {model_type} wrapper ({wrapper.architecture}) but has no text_config "
                              "with a model_type (expected the language model's config under text_config)")
    if text["model_type"] != wrapper.text_model_type:
        raise CheckpointError(f"config.json is a {model_type} wrapper whose text_config has model_type "
                              f"{text['model_type']!r}; expected {wrapper.text_model_type!r}")
    text = dict(text)
    if "tie_word_embeddings" in config:  # transformers ties the wrapper's head by the top-level flag
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return Layout(model_type=text["model_type"], config=text, wrapper=model_type, text_prefix=wrapper.text_prefix,
                  dropped=wrapper.dropped)
