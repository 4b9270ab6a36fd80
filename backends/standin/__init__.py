"""The stand-in device: a measuring tool for the engine's host loop, not a model.

Real tokenizer, chat template, sampling, detokenising, stop strings and SSE; a forward that
only waits a set time per step (``INFERFLUX_STANDIN_STEP``) and returns cheap, deterministic
logits. See docs/backends.md ("The stand-in device") and docs/benchmarks.md.
"""

from inferflux.backends.standin.backend import STEP_ENV, StandinBackend, StepTime

__all__ = ["STEP_ENV", "StandinBackend", "StepTime"]
