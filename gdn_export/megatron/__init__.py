"""Megatron-core hybrid checkpoints (torch_dist and legacy): GDN, GDN2 and Gated DeltaProduct mixers (docs/MEGATRON.md)."""
