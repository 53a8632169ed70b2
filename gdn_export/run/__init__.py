"""The run side: archives in, tokens out. Depends on numpy and tract only (torch is never imported here).

``session`` runs one archive's graph with its states carried; ``generation`` samples and detokenizes;
``serving`` batches concurrent requests (``Engine``); ``http`` is the OpenAI-compatible server.
"""
