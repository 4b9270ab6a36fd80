"""Framework-neutral serving engine: scheduling, paged-KV bookkeeping, sampling,
detokenisation. Imports no torch/mlx; the backend (backends/base.py) owns tensors.

See docs/architecture.md for the seam this package implements.
"""

from .async_engine import AsyncEngine
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .embedding import EmbeddingRequest, EmbeddingResult
from .errors import (
    BlockManagerError,
    CacheCapacityError,
    DuplicateRequestError,
    EmbeddingsUnsupportedError,
    EmptyPromptError,
    EngineConfigError,
    EngineDeadError,
    EngineError,
    EngineStepError,
    GrammarBusyError,
    GrammarCancelledError,
    GrammarTooComplexError,
    InputTooLongError,
    InvalidPromptError,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParamsError,
)
from .grammar_sandbox import DEFAULT_BUDGET, GrammarBudget
from .guided import GuidedSpec
from .llm_engine import DEFAULT_KV_CACHE_BYTES, EngineConfig, LLMEngine
from .outputs import EngineStats, RequestOutput, RequestTimings, TokenLogprob
from .request import EngineRequest
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus

__all__ = [
    "AsyncEngine",
    "BlockManager",
    "BlockManagerError",
    "CacheCapacityError",
    "DEFAULT_BUDGET",
    "DEFAULT_KV_CACHE_BYTES",
    "DuplicateRequestError",
    "EmbeddingRequest",
    "EmbeddingResult",
    "EmbeddingsUnsupportedError",
    "EmptyPromptError",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineRequest",
    "EngineError",
    "EngineStats",
    "EngineStepError",
    "GrammarBudget",
    "GrammarBusyError",
    "GrammarCancelledError",
    "GrammarTooComplexError",
    "GuidedSpec",
    "IncrementalDetokenizer",
    "InputTooLongError",
    "InvalidPromptError",
    "InvalidRequestError",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "RequestTimings",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "TokenLogprob",
]
