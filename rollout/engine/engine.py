"""The engine: requests in, tokens out, one `step()` at a time.

`generate()` is the synchronous front door; the server drives `add_request`/`step`/`abort`
itself. Each step: the scheduler picks the batch, speculation plans its draft rows (spec/), the
runner drafts, computes and verifies on the device, and what it emitted is appended up to each
sequence's stop condition, so that speculation never changes the output.

The engine holds its parts and hands each role to a collaborator of its own: building the parts
from the config (build.py), requests in (intake.py), the step loop: schedule, launch, complete,
emit (step_loop.py, over scheduler.py, model_runner.py with spec/drafters.py, and emit.py), the
weights and their version (weights.py), GPU memory for a colocated trainer (memory.py), the
counters (stats.py), and the other tensor-parallel ranks (tensor_parallel.py). What stays here
is the API, and what every rank replays.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Iterable
from dataclasses import replace

import torch

from rollout.config import EngineConfig, SamplingParams, SpecConfig, core_share
from rollout.engine.build import build_parts, keep_host_heap, resolve_device
from rollout.engine.emit import Output, output
from rollout.engine.intake import Intake
from rollout.engine.memory import DeviceMemory, MemoryStateError, memory_tags
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Request, Sequence
from rollout.engine.stats import EngineStats
from rollout.engine.step_loop import StepLoop
from rollout.engine.tensor_parallel import flush, replay, start_ranks
from rollout.engine.weights import EngineWeights, RankSwap
from rollout.models.config import ModelConfig
from rollout.models.default_model import resolve_model_path
from rollout.models.sharding import Shard
from rollout.models.weights import checkpoint_specs, iter_checkpoint

log = logging.getLogger("rollout")


def freeze_heap() -> None:
    """Hide every object alive now from Python's cyclic garbage collector: for a process that
    has built its engine and keeps it. A full collection would walk the engine's hundreds of
    thousands of objects (modules, tensors, the tokenizer, compiled kernels) at whichever step
    crosses the collector's threshold. Frozen objects are still freed by reference counting;
    only cycles among them outlive the freeze, so call `gc.unfreeze()` before dropping an
    engine whose memory must come back.
    """
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_heap` once an engine is dropped, so that its memory (the KV pool) comes back."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Engine:
    def __init__(
        self,
        model: str = "default",
        spec: str | SpecConfig = "auto",
        device: str = "auto",
        config: EngineConfig | None = None,
        *,
        tp_follower: tuple | None = None,
        tp_hooks: str | None = None,
        share_weights_with: "Engine | None" = None,
        **overrides,
    ):
        """Tensor parallelism (rollout/engine/tensor_parallel.py): `tp_follower` is (rank, port, pipe)
        of a rank > 0, given by the process rank 0 starts; `tp_hooks` ("module:function") gives
        those processes handlers of their own (a server's). `share_weights_with`: serve that engine's
        model object instead of building one (build.check_shareable)."""
        spec_overrides = {k.removeprefix("spec_"): overrides.pop(k) for k in list(overrides) if k.startswith("spec_")}
        if spec_overrides:  # Engine(spec="eagle", spec_draft_model=PATH), as the CLI's --spec-draft-model
            spec = replace(spec, **spec_overrides) if isinstance(spec, SpecConfig) else SpecConfig(method=spec, **spec_overrides)
        self.config = config or EngineConfig(model=model, spec=spec, device=device, **overrides)
        cfg = self.config
        self.device = resolve_device(cfg.device, cfg.base_gpu_id + (tp_follower[0] if tp_follower is not None else 0))
        if self.device.type == "cuda":  # Triton launches and graph captures go to the current GPU: make it ours
            torch.cuda.set_device(self.device)
        self.model_path = resolve_model_path(cfg.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        Shard.check(self.model_config, cfg.tp_size)  # before any rank starts
        self.tp = start_ranks(cfg, self.device, tp_follower, tp_hooks)  # None with one rank
        self._caller_threads = torch.get_num_threads()  # (rank 0 runs in the caller's process: `close` restores it)
        if self.device.type == "cpu":
            keep_host_heap()
            if cfg.cpu_threads or cfg.tp_size > 1:  # processes that share the cores
                torch.set_num_threads(cfg.cpu_threads or core_share(cfg.tp_size))
        p = build_parts(cfg, self.device, self.tp, self.model_path, self.model_config, share_weights_with)
        self.dtype, self.shard = p.dtype, p.shard
        self.tokenizer = p.tokenizer
        self.max_model_len, self.max_prefill_tokens = p.max_model_len, p.max_prefill_tokens
        self.model, self.pool, self.table, self.spec, self.runner = p.model, p.pool, p.table, p.spec, p.runner
        # the collaborators: requests in, the step loop (scheduler, runner, emitter), weights, memory, counters
        self.intake = Intake(cfg, self.tokenizer, self.model_config.vocab_size, p.eos_token_ids, self.max_model_len,
                             self.pool.num_slots - 1)
        self.scheduler = Scheduler(self.pool, cfg.max_running_seqs, self.max_prefill_tokens, self._released,
                                   cfg.schedule_conservativeness)
        self.counters = EngineStats()
        self.weights = EngineWeights(self.model, self.runner.drafters.head, self.device, self.tp,
                                     before=lambda: self.loop.complete_in_flight(), after=self._weights_swapped)
        self.loop = StepLoop(cfg, self.scheduler, self.runner, self.spec, self.counters, self.tp, self.tokenizer,
                             self.dtype, lambda: self.weights.version)
        self.emitter = self.loop.emitter
        self.memory = DeviceMemory(self.device, self.model, self.pool, self.runner)

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def requests(self) -> dict[str, Request]:
        """The requests in flight, by rid."""
        return self.loop.requests

    @property
    def released(self) -> set[str]:
        """Memory let go by release_memory: nothing runs until it is back."""
        return self.memory.released

    def recover(self) -> list[Request]:
        """After a step raised: drop every request and start over with an empty KV pool (the model
        and its weights are untouched). Returns the requests dropped, for their callers to fail.
        Not under tensor parallelism: the ranks may have failed apart, so the group restarts."""
        if self.tp is not None:
            raise RuntimeError("a tensor-parallel engine does not recover from a failed step: restart it")
        dropped = list(self.requests.values())
        self.loop.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.pool.reset()
        self.table.lengths.zero_()
        self.scheduler.reset()
        self.spec.reset()
        return dropped

    # ---------------- requests ----------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> Request:
        prompt_ids = self.intake.prompt_ids(prompt)
        params = self.intake.checked(params or SamplingParams(), prompt_ids, top_logprobs_num)
        rid = rid if rid is not None else self.intake.rid()
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        seed = self.intake.seed(params, prompt_ids)
        if self.tp is not None:
            replay(self.tp, "_admit", prompt_ids, dataclasses.asdict(params), rid, seed, return_logprob, top_logprobs_num)
        return self._admit(prompt_ids, params, rid, seed, return_logprob, top_logprobs_num)

    def _admit(self, prompt_ids: list[int], params: SamplingParams | dict, rid: str, seed: int, return_logprob: bool,
               top_logprobs_num: int) -> Request:
        """A checked request into the loop (what a tensor-parallel rank > 0 replays, `params` as a dict)."""
        if isinstance(params, dict):
            params = SamplingParams.validated(params)
        req = self.intake.request(prompt_ids, params, rid, seed, return_logprob, top_logprobs_num)
        self.loop.admit(req)
        return req

    def abort(self, rid: str) -> bool:
        """Stop a request now; it is returned by the next `step()` with finish_reason abort."""
        req = self.requests.get(rid)
        if req is None:
            return False
        replay(self.tp, "abort", rid)
        self.loop.abort(req)
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their rids."""
        rids = [rid for rid, req in self.requests.items() if not req.finished]
        for rid in rids:
            self.abort(rid)
        return rids

    # ---------------- the loop (rollout/engine/step_loop.py) ----------------
    @property
    def has_work(self) -> bool:
        return self.loop.has_work

    def step(self) -> list[Request]:
        """Run one batch (StepLoop.step); returns the requests that progressed (check `.finished`)."""
        if self.released:
            raise MemoryStateError(f"memory released ({', '.join(sorted(self.released))}): resume it before stepping")
        replay(self.tp, "step")
        updated = self.loop.step()
        flush(self.tp)
        return updated

    def drain(self) -> list[Request]:
        """Complete the step in flight, if any (the overlap schedule leaves one running between
        steps), so that nothing runs until the next `step()`; returns what `step()` would."""
        replay(self.tp, "drain")
        return self.loop.drain()

    def _released(self, seq: Sequence) -> None:
        """The scheduler is about to free `seq`'s KV row: its tokens leave the index, kept as
        history if it finished (not if it was preempted: it comes back)."""
        self.spec.leave(seq, keep=seq.finish_reason is not None)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 return_logprob: bool = False) -> list[list[Output]]:
        """Run prompts to completion: one list per prompt, `n` outputs each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        reqs = [self.add_request(p, sp, return_logprob=return_logprob) for p, sp in zip(prompts, sampling_params)]
        for req in reqs:  # in turn: a scan of them all each step took ~0.1 ms at 64 x 8 samples on a CPU
            while not req.finished:
                self.step()
        return [[self.output(s) for s in r.detach()] for r in reqs]

    def output(self, seq: Sequence) -> Output:
        return output(seq, self.tokenizer)

    # ---------------- tensor parallelism (rollout/engine/tensor_parallel.py) ----------------
    REPLAYED = ("_admit", "abort", "step", "drain", "invalidate_kv", "release_memory", "resume_memory",
                "clear_speculation_history", "_swap_replayed")

    def follow(self, handlers: dict | None = None) -> None:
        """A rank > 0: replay rank 0's calls until it stops; `handlers` take the calls that are not
        the engine's (a server's weight receiver)."""
        handlers = handlers or {}
        while True:
            name, *args = self.tp.next()
            if name == "stop":
                return
            if name in handlers:
                handlers[name](*args)
            elif name in self.REPLAYED:
                getattr(self, name)(*args)
            else:
                raise RuntimeError(f"tensor-parallel rank {self.tp.rank} cannot replay {name!r}")

    def close(self) -> None:
        """Rank 0: stop the other tensor-parallel ranks; every rank: close their group (nothing to
        do with one rank). The CUDA graphs go first: finalizing NCCL while the graphs that captured
        its collectives were alive hung on the GPU (docs/tensor-parallel.md). The caller's torch
        threads are its own again (a TP2 engine on the CPU halved them for what ran after it)."""
        if self.tp is not None:
            self.runner.drop_graphs()
            gc.collect()
            self.tp.close()
        torch.set_num_threads(self._caller_threads)

    # ---------------- weights (rollout/engine/weights.py) ----------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None, recompute_kv: bool = True
    ) -> int:
        """Replace weights by HF name, all or nothing; returns the new weight version.

        Call between steps. Running sequences continue under the new weights; by default
        their KV is recomputed (they are preempted and re-prefilled), so no token mixes
        two versions in its context.
        """
        staged = list(named_tensors)
        return self.weights.swap([(n, tuple(t.shape), t.dtype) for n, t in staged], staged, version, recompute_kv)

    def update_weights_from_disk(self, path: str, version: int | None = None, recompute_kv: bool = True) -> int:
        """`update_weights` from a safetensors checkpoint, streamed file by file once every shape checks
        (each tensor-parallel rank reads its part)."""
        path = resolve_model_path(path)
        return self.weights.swap(checkpoint_specs(path), iter_checkpoint(path, self.weights.targets()), version,
                                 recompute_kv, RankSwap("disk", str(path)))

    def update_weights_staged(self, specs, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                              recompute_kv: bool = True) -> int:
        """`update_weights` of tensors a server's receiver staged for `version` (whole, or this rank's
        parts of the (name, shape, dtype) `specs`); under tensor parallelism every rank received its
        own copy (`weights.staged`), and all swap or none."""
        return self.weights.swap(specs, tensors, version, recompute_kv, RankSwap("staged", None))

    def _swap_replayed(self, version: int, recompute_kv: bool, how: str, where) -> None:
        """A rank > 0's side of rank 0's swap."""
        self.weights.swap_replayed(version, recompute_kv, how, where)

    def _weights_swapped(self, head_pushed: bool, recompute_kv: bool) -> None:
        self.spec.on_weights(self.weights.version, head_pushed)
        if recompute_kv:
            self._drop_kv()

    # ---------------- memory (a colocated trainer's turn on the GPU) ----------------
    def release_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Let go of GPU memory while no sequence holds KV (rollout/engine/memory.py; None: all tags).
        Nothing runs until all is back; requests that arrive meanwhile wait."""
        tags = memory_tags(tags)
        if self.pool.used_slots:
            raise MemoryStateError(f"{len(self.scheduler.running)} sequence(s) hold KV cache: abort them or wait "
                                   "(pause_generation) before releasing memory")
        replay(self.tp, "release_memory", sorted(tags))
        return self.memory.release(tags)

    def resume_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Take back what `release_memory` let go (None: all)."""
        tags = memory_tags(tags) & self.released
        replay(self.tp, "resume_memory", sorted(tags))
        flush(self.tp)  # (graphs are captured again: collectives)
        return self.memory.resume(tags)

    def invalidate_kv(self) -> None:
        """Drop every cached KV entry; running and half-prefilled sequences are recomputed."""
        replay(self.tp, "invalidate_kv")
        self._drop_kv()

    def _drop_kv(self) -> None:
        """invalidate_kv's work, also inside a weight swap (which every rank replays whole)."""
        self.loop.complete_in_flight()
        self.scheduler.preempt_all()

    # ---------------- speculation's history, the counters (rollout/engine/stats.py) ----------------
    def clear_speculation_history(self) -> None:
        """Forget earlier requests' outputs (benchmarks: no drafting from a previous run)."""
        replay(self.tp, "clear_speculation_history")
        self.spec.clear_history()

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of stepping since the last reset_stats()."""
        return self.counters.tokens_per_s

    @property
    def output_tokens(self) -> int:
        """Output tokens appended since the last reset_stats()."""
        return self.counters.output_tokens

    @property
    def step_log(self):
        """The latest steps (StepRecord), for profiles."""
        return self.counters.step_log

    def reset_stats(self) -> None:
        self.counters.reset()

    def stats(self) -> dict:
        return {
            **self.counters.counts(),
            "rollout/weight_version": self.weights.version,
            "rollout/weight_sync_s": self.weights.sync_s,
            "rollout/num_running": len(self.scheduler.running),
            "rollout/num_waiting": len(self.scheduler.waiting),
            "rollout/kv_usage": self.pool.used_slots / (self.pool.num_slots - 1),
            "rollout/num_preempted": self.scheduler.num_preempted,
            "rollout/num_overflowed": self.emitter.overflowed,  # samples aborted because a forward overflowed
            **self.spec.stats(),
        }
