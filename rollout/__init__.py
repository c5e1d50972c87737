"""RL-rollout generation backend with training-free n-gram tree speculation."""

from rollout.config import EngineConfig, SamplingParams, SpecConfig
from rollout.engine import Engine, Output

__all__ = ["Engine", "EngineConfig", "Output", "SamplingParams", "SpecConfig"]
