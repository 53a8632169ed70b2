"""The float weight format (``quantize=None``, the default): every weight in the graph's dtype (``--dtype``), written
by the streamed writers as it is read. format.py is its registry entry; it has no codec of its own."""
