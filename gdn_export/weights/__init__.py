"""How weights reach an archive: streamed from their source (``streamed``), and in which encoding (``q4_0``)."""
