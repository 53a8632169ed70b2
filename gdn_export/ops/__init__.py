"""The custom operators, one folder each (gated_delta_rule/, causal_conv1d/, moe_ffn/): schema and torch
registration, naive reference, decisions and one lowering module per back-end. protocol.py and options.py are what
they share (the Decision record, the export's plan); nnef_handlers.py lists the ops an NNEF export registers.
``gdn_export.gated_delta_rule`` & co. are the public names (docs/ARCHITECTURE.md)."""
