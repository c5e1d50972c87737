"""GPU memory an engine lets go while a colocated trainer has its turn on the GPU, and takes back.

Tags (rollout.config.MEMORY_TAGS): `kv_cache` (the KV pool), `weights` (moved to pinned host
memory), `cuda_graph` (the captured graphs and their pool; releasing either of the others drops
them too, as they hold those addresses).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.config import MEMORY_TAGS
from rollout.engine.kv_pool import KVPool
from rollout.engine.model_runner import ModelRunner
from rollout.models.llama import CausalLM


class MemoryStateError(RuntimeError):
    """Memory cannot be released now (requests in flight); the HTTP answer is 409."""

    status = 409


def memory_tags(tags: Iterable[str] | None) -> set[str]:
    """The tags asked for (None: all), checked."""
    tags = set(MEMORY_TAGS if tags is None else tags)
    unknown = tags - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tag(s) {sorted(unknown)}: choose from {', '.join(MEMORY_TAGS)}")
    return tags


class DeviceMemory:
    """What is released now (`released`: nothing runs until it is empty again)."""

    def __init__(self, device: torch.device, model: CausalLM, pool: KVPool, runner: ModelRunner):
        self.device, self.model, self.pool, self.runner = device, model, pool, runner
        self.released: set[str] = set()

    def release(self, tags: set[str]) -> dict:
        if self.runner.graphs is None:
            tags.discard("cuda_graph")
        if "weights" in tags and self.model.shared:
            raise MemoryStateError("the weights are served by another engine too (share_weights_with): they stay")
        before = self._bytes()
        new = tags - self.released
        if new:
            self.runner.drop_graphs()
        if "kv_cache" in new:
            self.pool.free_memory()
        if "weights" in new:
            self.model.to_host()
        self.released |= tags
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return {"released": sorted(self.released), "freed_bytes": before - self._bytes()}

    def resume(self, tags: set[str]) -> dict:
        """Take back `tags` (of those released); graphs are captured again once nothing is released."""
        tags &= self.released
        before = self._bytes()
        if "weights" in tags:
            self.model.to(self.device)
        if "kv_cache" in tags:
            self.pool.allocate()
        self.released -= tags
        graphs = self.runner.graphs
        if not self.released and graphs is not None and not graphs.captured:
            graphs.capture_all()
        return {"released": sorted(self.released), "allocated_bytes": self._bytes() - before}

    def _bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
