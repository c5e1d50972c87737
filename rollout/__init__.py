"""RL-rollout generation backend with training-free n-gram tree speculation.

    from rollout import Engine, SamplingParams

Layers, lowest first (each imports only those below it): `rollout.config`; `kernels/`;
`rollout.models` (the decoder, loading weights); `rollout.engine` (scheduling, the KV pool, the
token table, steps) with `spec/` (speculation); `rollout.server` (HTTP front end and the
engine process); `rollout.tools` (CLI, bench, launcher, datasets, W&B) and `rollout.client`.
The names below load on first use, so that importing any one layer does not import the engine.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "Engine": "rollout.engine.engine", "Output": "rollout.engine.engine",
    "EngineConfig": "rollout.config", "SamplingParams": "rollout.config", "SpecConfig": "rollout.config",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
