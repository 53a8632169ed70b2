"""A weight format of the tests' own, added as a new format is (docs/ARCHITECTURE.md, "Adding a weight format"): this
folder, its format.py (the registry entry, registered on import) and its codec.py (how a tensor is stored and read
back). ``bf16r``: every linear layer's weight rounded to bfloat16's precision, stored in float32 (the graph is
unchanged); nothing else of gdn_export knows it."""
