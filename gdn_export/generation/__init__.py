"""Generation over exported models: sampling, incremental text, stop strings, chat templates, and the executor
interface that runs requests (today a ``Session`` or a pool of worker threads; issue 11's batched ``Engine`` later).

``gdn_export.generate(session, prompt, ...)`` is the entry point; ``gdn_export.server`` serves it over HTTP.
"""

from gdn_export.generation.executor import (ArchiveText, Executor, ExecutorFull, InlineExecutor, TokenEvent,
                                            TokenRequest, TokenStream, WorkerPool)
from gdn_export.generation.generate import GeneratedToken, Generation, RequestError, generate, sampling_from
from gdn_export.generation.sampling import Choice, Sampler, SamplingError, SamplingParams

__all__ = ["ArchiveText", "Choice", "Executor", "ExecutorFull", "GeneratedToken", "Generation", "InlineExecutor",
           "RequestError", "Sampler", "SamplingError", "SamplingParams", "TokenEvent", "TokenRequest", "TokenStream",
           "WorkerPool", "generate", "sampling_from"]
