"""Generation: the built-in engine on the model's inference cache, sampling, the prefix cache (docs/generation.md)."""

from trainer.engine.engine import Completion, Engine, PromptFormat, Request, RolloutBackend, serving_module
from trainer.engine.prefix_cache import PrefixCache
from trainer.engine.sampling import SamplingParams

__all__ = ["Completion", "Engine", "PrefixCache", "PromptFormat", "Request", "RolloutBackend", "SamplingParams",
           "serving_module"]
