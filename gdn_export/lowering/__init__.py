"""NNEF lowerings of gated delta-rule nodes and the emitter that chooses between them."""
