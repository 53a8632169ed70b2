"""How weights reach an archive: streamed from their source (``streamed``), and in which format, one folder each
(``float``, ``q4_0``, ``int8``, ``f16``), listed by the registry ``formats`` (docs/ARCHITECTURE.md, "Adding a weight
format")."""
