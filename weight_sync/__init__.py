"""Live weight updates from a trainer: `WeightPusher` (trainer side), `WeightReceiver` (engine side).

Imports are lazy so that a trainer importing the pusher does not load the engine.
"""

from weight_sync.errors import WeightSyncError

__all__ = ["WeightPusher", "WeightReceiver", "WeightSyncError"]


def __getattr__(name: str):
    if name == "WeightPusher":
        from weight_sync.pusher import WeightPusher

        return WeightPusher
    if name == "WeightReceiver":
        from weight_sync.receiver import WeightReceiver

        return WeightReceiver
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
