"""Generation over exported models: sampling, incremental text, stop strings, chat templates, and the executor
interface that runs requests (today a ``Session`` or a pool of worker threads; issue 11's batched ``Engine`` later).

``gdn_export.generate(session, prompt, ...)`` is the entry point; ``gdn_export.run.http`` serves it over HTTP.
"""

from gdn_export.run.generation.executor import (ArchiveText, Executor, ExecutorFull, InlineExecutor, TokenEvent,
                                            TokenRequest, TokenStream, WorkerPool)
from gdn_export.run.generation.generate import GeneratedToken, Generation, RequestError, generate, sampling_from
from gdn_export.run.generation.sampling import Choice, Sampler, SamplingError, SamplingParams
from gdn_export.run.generation.speculative import SpeculativeConfig, SpeculativeError

__all__ = ["ArchiveText", "Choice", "Executor", "ExecutorFull", "GeneratedToken", "Generation", "InlineExecutor",
           "RequestError", "Sampler", "SamplingError", "SamplingParams", "SpeculativeConfig", "SpeculativeError",
           "TokenEvent", "TokenRequest", "TokenStream", "WorkerPool", "generate", "sampling_from"]
