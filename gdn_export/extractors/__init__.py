"""torch-to-nnef entry points: custom-op handlers and module extractors, all handing nodes to the emitter."""

from gdn_export.extractors import custom_ops, modules  # noqa: F401  (registration on import)
