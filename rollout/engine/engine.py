"""The engine: requests in, tokens out, one `step()` at a time.

`generate()` is the synchronous front door; the server drives `add_request`/`step`/`abort`
itself. Each step: the scheduler picks the batch, speculation plans its draft rows (spec/), the
runner drafts, computes and verifies on the device, and what it emitted is appended up to each
sequence's stop condition, so that speculation never changes the output.

The engine holds its parts and steps them; each role is a module of its own: building the
parts from the config (build.py), running the model (model_runner.py, with drafters.py),
scheduling (scheduler.py), appending emitted tokens (emit.py), GPU memory for a colocated
trainer (memory.py), and the other tensor-parallel ranks (tensor_parallel.py). What stays
here: intake, the overlap loop, weight swaps, and the statistics.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from rollout.config import MAX_TOP_LOGPROBS, EngineConfig, SamplingParams, SpecConfig, core_share, request_limit
from rollout.engine.build import build_parts, keep_host_heap, resolve_device
from rollout.engine.emit import Emitter, Output, output
from rollout.engine.memory import DeviceMemory, MemoryStateError, memory_tags
from rollout.engine.sampler import prompt_seed, sequence_key
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Request, Sequence, SpecCounters, Status
from rollout.engine.step import Batch, Emitted, StepInFlight, StepRecord
from rollout.engine.tensor_parallel import start_ranks
from rollout.models.config import ModelConfig
from rollout.models.loader import resolve_model_path
from rollout.models.sharding import Shard
from rollout.models.weights import WeightError, check_weights, checkpoint_specs, copy_weights, iter_checkpoint
from spec.budget import StepPlan
from spec.step import HeadWork, Source

log = logging.getLogger("rollout")

HEAD_PREFIX = "draft."  # a draft head's tensors in a weight push: its checkpoint names after this
STEP_LOG = 1 << 16  # steps Engine.step_log keeps (a server runs for days: it must not grow)


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
        **overrides,
    ):
        """Tensor parallelism (rollout/engine/tensor_parallel.py): `tp_follower` is (rank, port, pipe)
        of a rank > 0, given by the process rank 0 starts; `tp_hooks` ("module:function") gives
        those processes handlers of their own (a server's)."""
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
        p = build_parts(cfg, self.device, self.tp, self.model_path, self.model_config)
        self.dtype, self.shard = p.dtype, p.shard
        self.tokenizer, self.eos_token_ids = p.tokenizer, p.eos_token_ids
        self.max_model_len, self.max_prefill_tokens = p.max_model_len, p.max_prefill_tokens
        self.model, self.pool, self.table, self.spec, self.runner = p.model, p.pool, p.table, p.spec, p.runner
        self.staged_weights = None  # a rank > 0's own copy of a pushed update, by version (set by its server)
        self.scheduler = self._new_scheduler()
        self.emitter = Emitter(self.tokenizer, self._finish, overflow_message(self.dtype))
        self.memory = DeviceMemory(self.device, self.model, self.pool, self.runner)
        self.weight_version = 0
        self.requests: dict[str, Request] = {}
        self._updated: dict[int, Request] = {}  # reported by the next step(): aborted, or completed by a drain
        self._ended: dict[int, Request] = {}  # requests with a sequence finished since the last _collect
        self._in_flight: StepInFlight | None = None  # a decode or verify step left running
        self._last_done = 0.0  # when the last step completed
        self._rng = random.Random(cfg.seed)
        self._seq_ids = itertools.count()
        self._rids = itertools.count()
        self._weight_sync_s = 0.0
        self._editing_logits = 0  # live requests whose logits are edited: their steps need the host's tokens
        self.reset_stats()

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
        self.requests.clear()
        self._updated, self._ended, self._in_flight = {}, {}, None
        self._editing_logits = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.pool.reset()
        self.table.lengths.zero_()
        self.scheduler = self._new_scheduler()
        self.spec.reset()
        return dropped

    def _new_scheduler(self) -> Scheduler:
        cfg = self.config
        return Scheduler(self.pool, cfg.max_running_seqs, self.max_prefill_tokens, self._released,
                         cfg.schedule_conservativeness)

    # ---------------- requests ----------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> Request:
        params = self._checked(params or SamplingParams())
        prompt_ids = self._encode(prompt)
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        if not (isinstance(top_logprobs_num, int) and 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}] (got {top_logprobs_num!r})")
        broken = request_limit(len(prompt_ids), params, self.max_model_len, self.config.max_running_seqs,
                               self.pool.num_slots - 1)
        if broken is not None:
            raise ValueError(f"{broken[0]}: {broken[1]}")
        if params.seed is not None:
            seed = params.seed
        elif self.config.coupled_sampling:  # every rollout of this prompt draws with the same noise
            seed = prompt_seed(prompt_ids, self.config.seed)
        else:
            seed = self._rng.getrandbits(63)
        if self.tp is not None:
            self._replay("_admit", prompt_ids, dataclasses.asdict(params), rid, seed, return_logprob, top_logprobs_num)
        return self._admit(prompt_ids, params, rid, seed, return_logprob, top_logprobs_num)

    def _admit(self, prompt_ids: list[int], params: SamplingParams | dict, rid: str, seed: int, return_logprob: bool,
               top_logprobs_num: int) -> Request:
        """A checked request into the scheduler (what a tensor-parallel rank > 0 replays, `params` as a dict)."""
        if isinstance(params, dict):
            params = SamplingParams.validated(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = Request(rid, prompt_ids, params, seed, return_logprob, top_logprobs_num, stop_ids=stop_ids,
                      max_len=len(prompt_ids) + params.max_new_tokens)  # within max_model_len, checked above
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), req, i, sequence_key(seed, i), list(prompt_ids), len(prompt_ids))
            req.sequences.append(seq)
        leader, *forks = req.sequences
        leader.forks = forks
        self.requests[rid] = req
        self._editing_logits += req.edits_logits
        self.scheduler.add(leader)
        return req

    # ---------------- tensor parallelism (rollout/engine/tensor_parallel.py) ----------------
    REPLAYED = ("_admit", "abort", "step", "drain", "invalidate_kv", "release_memory", "resume_memory",
                "clear_speculation_history", "_swap_replayed")

    def _replay(self, name: str, *args) -> None:
        """Rank 0: a call the other ranks make too (sent before the next collective)."""
        if self.tp is not None and self.tp.leads:
            self.tp.record(name, *args)

    def _flush_replay(self) -> None:
        if self.tp is not None and self.tp.leads:
            self.tp.flush()

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

    def _checked(self, params: SamplingParams) -> SamplingParams:
        """The request's params, checked against what this engine can ever run."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids must be in [0, {vocab}) (got {bad[0]})")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ValueError(f"sampling_params.logit_bias keys must be token ids in [0, {vocab}) (got {bad[0]})")
        if params.top_k >= vocab:  # keeps every token: no truncation at all
            params = dataclasses.replace(params, top_k=-1)
        return params

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def abort(self, rid: str) -> bool:
        """Stop a request now; it is returned by the next `step()` with finish_reason abort."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._replay("abort", rid)
        for seq in req.sequences:
            if not seq.finished:
                seq.forks = []
                self._finish(seq, "abort")
        self._updated[id(req)] = req
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their rids."""
        rids = [rid for rid, req in self.requests.items() if not req.finished]
        for rid in rids:
            self.abort(rid)
        return rids

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None or bool(self._updated)

    # ---------------- the loop ----------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that progressed (check `.finished`).

        With the overlap schedule (on by default), a decode or verify step is left running on
        the device when `step()` returns, and the next call launches the following one before
        it collects the earlier one: the host's bookkeeping of one step hides under the device's
        work on the next. A decode or verify step reads what it needs from the device (each
        sequence's last token and length, its drafts), so steps chain whether they draft or not;
        a sequence that stops in the earlier step has its tokens from the later one dropped.
        Prefill steps need the host's view of every token, and so do steps whose logits are
        edited (rollout/engine/logits_processing.py): the pipeline drains before them.
        """
        if self.released:
            raise MemoryStateError(f"memory released ({', '.join(sorted(self.released))}): resume it before stepping")
        self._replay("step")
        updated, self._updated = self._updated, {}
        began = time.perf_counter()
        prev, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        chain = (prev is not None and batch is not None and not batch.is_prefill and self.config.overlap_schedule
                 and not self._editing_logits)
        if chain:
            launched = self._launch(batch, began, after=prev)
            self._complete(prev, updated)
            if all(seq.finished for seq in batch.seqs):  # nothing left to wait for
                self._complete(launched, updated)
            else:
                self._in_flight = launched
        else:
            if prev is not None:
                self._complete(prev, updated)
                batch = _without_finished(batch)
            if batch is not None:
                launched = self._launch(batch, began)
                if self.config.overlap_schedule and launched.chainable and not self._editing_logits:
                    self._in_flight = launched
                else:
                    self._complete(launched, updated)
        self._busy_s += time.perf_counter() - began
        self._flush_replay()
        return self._collect(updated)

    def _launch(self, batch: Batch, began: float, after: StepInFlight | None = None) -> StepInFlight:
        """Launch `batch`'s step; `after`: the step it follows, still in flight."""
        if batch.is_prefill:
            slots, positions, starts = self.scheduler.place_prefill(batch)
            head = self._prefill_head(new_prompts=bool((starts == 0).any()))
            self._flush_replay()
            step = self.runner.launch_prefill(batch, slots, positions, starts, head)
        else:
            plan = self._plan(len(batch.seqs))
            self.spec.before_decode(plan.drafting)
            self._draft_steps += plan.draft_rows > 0
            slots = self.scheduler.step_slots(len(batch.seqs) + plan.draft_rows)
            self._flush_replay()
            step = self.runner.launch_decode(batch, slots, plan.draft_rows, plan.drafting, plan.head, plan.shadow, after)
        step.began = began
        return step

    def _prefill_head(self, new_prompts: bool) -> bool:
        """Whether a prefill step runs the draft head (the head's cycle decides)."""
        (head,) = self._rank0_choice("prefill_head", lambda: (int(self.spec.head_for_prefill(new_prompts)),))
        return bool(head)

    def _plan(self, num_seqs: int) -> StepPlan:
        """The decode step's plan (the speculation budget's)."""
        def decide() -> tuple:
            plan = self.spec.plan(num_seqs, self.scheduler.free_slots, draining=not self.scheduler.waiting)
            return plan.draft_rows, plan.drafting, plan.shadow, int(plan.head)

        draft_rows, drafting, shadow, head = self._rank0_choice("plan", decide)
        return StepPlan(draft_rows, drafting, shadow, HeadWork(head))

    def _rank0_choice(self, name: str, decide) -> tuple:
        """`decide()`'s values: choices that weigh this process's measured step times, which differ
        by rank, so under tensor parallelism rank 0's, sent before the step's collectives (a rank
        that chose otherwise would run other collectives, and wait in them alone)."""
        if self.tp is not None and not self.tp.leads:
            return self.tp.expect(name)
        values = decide()
        if self.tp is not None:
            self.tp.record(name, *values)
        return values

    def _complete(self, step: StepInFlight, updated: dict) -> None:
        """Wait for a launched step and apply what it emitted."""
        began = step.began
        seqs = step.batch.seqs
        roots = np.fromiter((len(q.tokens) for q in seqs), np.int64, len(seqs)) if step.shadow else None
        emitted = self.runner.collect(step)
        if step.accepted is not None:
            self.scheduler.settle_step(step.batch, step.rows, step.slots, step.first_row, step.accepted)
        if step.batch.is_prefill:
            for item in step.batch.items:  # (a decode item may be waiting too: preempted while this step ran)
                if item.samples and not item.decode and item.seq.status is Status.WAITING:
                    for seq in [item.seq, *item.seq.forks]:
                        self.spec.join(seq)
                    self.scheduler.on_prefill_done(item.seq)
        tokens, head_tokens = self._append(emitted, updated)
        # A step's cost is the wall time it added: from its start, or from when the step before
        # it completed if they overlapped.
        done = time.perf_counter()
        cost = done - max(began, self._last_done)
        self._last_done = done
        prefill = step.batch.is_prefill
        device_s, host_s = (0.0 if prefill else step.result.device_seconds()), cost - step.result.waited
        self.step_log.append(StepRecord(len(seqs), step.draft_rows, prefill, cost * 1e3, device_s * 1e3, host_s * 1e3,
                                          began))
        self._steps += 1
        if not prefill:
            self.spec.observe(seqs, roots, step.trees, step.draft_rows, cost)
            if step.head != HeadWork.NONE:
                self.spec.observe_head_step(len(seqs), step.head == HeadWork.CHAIN, cost, tokens, head_tokens)
            if emitted.index_misses is not None:
                self.spec.observe_index(emitted.index_misses)
            if emitted.coupled is not None:
                self.spec.observe_coupled(emitted.coupled)

    def drain(self) -> list[Request]:
        """Complete the step in flight, if any (the overlap schedule leaves one running between
        steps), so that nothing runs until the next `step()`; returns what `step()` would."""
        self._replay("drain")
        self._complete_in_flight()
        updated, self._updated = self._updated, {}
        return self._collect(updated)

    def _complete_in_flight(self) -> None:
        """As drain(), keeping the progressed requests for the next step() to report."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step, self._updated)

    def _collect(self, updated: dict) -> list[Request]:
        ended, self._ended = self._ended, {}
        for req in ended.values():  # (only these can have finished: asking every updated request costs)
            if req.finished and self.requests.get(req.rid) is req:
                del self.requests[req.rid]
                self._editing_logits -= req.edits_logits
        return list(updated.values())

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of stepping since the last reset_stats()."""
        return self._output_tokens / self._busy_s if self._busy_s else 0.0

    @property
    def output_tokens(self) -> int:
        """Output tokens appended since the last reset_stats()."""
        return self._output_tokens

    def indexed(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(output tokens found in the token table, output tokens) of `seqs`: a running one's own row,
        a finished one's history row if it was kept. A host sync: for benchmarks and tests."""
        found = total = 0
        for seq in seqs:
            total += seq.num_output
            row = seq.row if not seq.finished else seq.history_row
            if row >= 0:
                have = self.table.read(row)[: len(seq.tokens)]
                found += sum(a == b for a, b in zip(have[seq.num_prompt :], seq.output_ids))
        return found, total

    def clear_speculation_history(self) -> None:
        """Forget earlier requests' outputs (benchmarks: no drafting from a previous run)."""
        self._replay("clear_speculation_history")
        self.spec.clear_history()

    def _released(self, seq: Sequence) -> None:
        """The scheduler is about to free `seq`'s KV row: its tokens leave the index, kept as
        history if it finished (not if it was preempted: it comes back)."""
        self.spec.leave(seq, keep=seq.finish_reason is not None)

    def _append(self, e: Emitted, updated: dict) -> tuple[int, int]:
        """Append what a step emitted (rollout/engine/emit.py); returns the tokens appended, and the
        draft head's accepted drafts among them."""
        appended, by_source = self.emitter.append(e, updated, self.weight_version, self._spec_totals)
        self._output_tokens += appended
        coupled = by_source.get(self.runner.drafters.source_names[Source.COUPLED])
        if coupled is not None:
            self.spec.observe_coupled_drafts(coupled[0], coupled[1])
        eagle = self.runner.drafters.head
        head = by_source.get(eagle.source) if eagle is not None else None
        if head is None:
            return appended, 0
        self.spec.observe_head(head[3], head[4])
        return appended, head[1]

    def _finish(self, seq: Sequence, reason: str, message: str | None = None) -> None:
        seq.finish_reason = reason
        seq.finish_message = message
        seq.finished_at = time.perf_counter()
        self._ended[id(seq.request)] = seq.request
        self.scheduler.finish(seq)

    # ---------------- the synchronous API ----------------
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        return_logprob: bool = False,
    ) -> list[list[Output]]:
        """Run prompts to completion: one list per prompt, `n` outputs each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        reqs = [self.add_request(p, sp, return_logprob=return_logprob) for p, sp in zip(prompts, sampling_params)]
        while not all(r.finished for r in reqs):
            self.step()
        return [[self.output(s) for s in r.sequences] for r in reqs]

    def output(self, seq: Sequence) -> Output:
        return output(seq, self.tokenizer)

    # ---------------- weights ----------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None, recompute_kv: bool = True
    ) -> int:
        """Replace weights by HF name, all or nothing; returns the new weight version.

        Call between steps. Running sequences continue under the new weights; by default
        their KV is recomputed (they are preempted and re-prefilled), so no token mixes
        two versions in its context.
        """
        staged = list(named_tensors)
        return self._swap_weights([(n, tuple(t.shape), t.dtype) for n, t in staged], staged, version, recompute_kv)

    def update_weights_from_disk(self, path: str, version: int | None = None, recompute_kv: bool = True) -> int:
        """`update_weights` from a safetensors checkpoint, streamed file by file once every shape checks
        (each tensor-parallel rank reads its part)."""
        path = resolve_model_path(path)
        return self._swap_weights(checkpoint_specs(path), iter_checkpoint(path, self.weight_targets()), version,
                                  recompute_kv, ranks_get=("disk", str(path)))

    def update_weights_staged(self, specs, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                              recompute_kv: bool = True) -> int:
        """`update_weights` of tensors a server's receiver staged for `version` (whole, or this rank's
        parts of the (name, shape, dtype) `specs`); under tensor parallelism every rank received its
        own copy (`staged_weights`), and all swap or none."""
        return self._swap_weights(specs, tensors, version, recompute_kv, ranks_get=("staged", None))

    def _swap_weights(self, specs, tensors: Iterable[tuple[str, torch.Tensor]], version: int | None,
                      recompute_kv: bool, ranks_get: tuple[str, object] | None = None) -> int:
        """The one door for new weights: every (name, shape, dtype) in `specs` is checked before any is copied.
        Under tensor parallelism the other ranks get theirs as `ranks_get` says (`_swap_replayed`):
        relayed from rank 0 (the default), read from disk, or their own staged copy."""
        specs = list(specs)
        t0 = time.perf_counter()
        self._complete_in_flight()  # the step in flight ran on the old weights; its tokens say so
        self.check_weights(specs)
        if self.tp is not None:
            version = self.weight_version + 1 if version is None else int(version)
            how, where = ranks_get or ("relay", [(n, list(shape), str(dtype).removeprefix("torch.")) for n, shape, dtype in specs])
            self.tp.record("_swap_replayed", version, recompute_kv, how, where)
            self.tp.flush()
            if how == "relay":
                tensors = [(n, self.tp.group.broadcast(t.to(self.device).contiguous())) for n, t in tensors]
            if not self.tp.group.agree(True):
                raise WeightError("weights rejected, nothing changed: another tensor-parallel rank did not receive them")
        self._apply_weights([name for name, _, _ in specs], tensors, version, recompute_kv)
        self._weight_sync_s = time.perf_counter() - t0
        return self.weight_version

    def _swap_replayed(self, version: int, recompute_kv: bool, how: str, where) -> None:
        """A rank > 0's side of rank 0's `_swap_weights`: its tensors, then the ranks' agreement."""
        self._complete_in_flight()
        tensors, ok = [], True
        targets = self.weight_targets()
        try:
            if how == "relay":  # every rank takes part in every broadcast, whatever it keeps
                for name, shape, dtype in where:
                    full = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                    tensors.append((name, targets[name].take(self.tp.group.broadcast(full)).clone()))
            elif how == "disk":
                tensors = list(iter_checkpoint(where, targets))
            else:
                tensors = self.staged_weights(version)
        except Exception:  # noqa: BLE001 - told to every rank by the agreement
            log.exception("tensor-parallel rank %d could not get weight version %d", self.tp.rank, version)
            ok = False
        if self.tp.group.agree(ok):
            self._apply_weights([n for n, _ in tensors], tensors, version, recompute_kv)

    def _apply_weights(self, names, tensors, version: int | None, recompute_kv: bool) -> None:
        copy_weights(self.weight_targets(), tensors)
        self._set_version(version)
        self.spec.on_weights(self.weight_version, any(name.startswith(HEAD_PREFIX) for name in names))
        if recompute_kv:
            self._drop_kv()

    def check_weights(self, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Raise WeightError unless every (name, shape, dtype) names one of the model's weights as it is."""
        check_weights(self.weight_targets(), list(specs), require_all=False)

    def weight_targets(self) -> dict:
        """The target's weights by HF name, and a draft head's under HEAD_PREFIX (a trainer that
        trains the head with the policy pushes both, by any method)."""
        targets = self.model.weight_targets()
        eagle = self.runner.drafters.head
        if eagle is not None:
            targets.update({HEAD_PREFIX + n: t for n, t in eagle.head.weight_targets().items()})
        return targets

    def _set_version(self, version: int | None) -> None:
        version = self.weight_version + 1 if version is None else int(version)
        if version <= self.weight_version:
            log.warning("weight version %d is not above the current %d", version, self.weight_version)
        self.weight_version = version

    # ---------------- memory (a colocated trainer's turn on the GPU) ----------------
    def release_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Let go of GPU memory while no sequence holds KV (rollout/engine/memory.py; None: all tags).
        Nothing runs until all is back; requests that arrive meanwhile wait."""
        tags = memory_tags(tags)
        if self.pool.used_slots:
            raise MemoryStateError(f"{len(self.scheduler.running)} sequence(s) hold KV cache: abort them or wait "
                                   "(pause_generation) before releasing memory")
        self._replay("release_memory", sorted(tags))
        return self.memory.release(tags)

    def resume_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Take back what `release_memory` let go (None: all)."""
        tags = memory_tags(tags) & self.released
        self._replay("resume_memory", sorted(tags))
        self._flush_replay()  # (graphs are captured again: collectives)
        return self.memory.resume(tags)

    def invalidate_kv(self) -> None:
        """Drop every cached KV entry; running and half-prefilled sequences are recomputed."""
        self._replay("invalidate_kv")
        self._drop_kv()

    def _drop_kv(self) -> None:
        """invalidate_kv's work, also inside a weight swap (which every rank replays whole)."""
        self._complete_in_flight()
        self.scheduler.preempt_all()

    # ---------------- stats ----------------
    def reset_stats(self) -> None:
        self._spec_totals = SpecCounters()
        self._output_tokens = 0
        self._busy_s = 0.0
        self._draft_steps = 0  # steps that verified drafts
        self._steps = 0
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)  # the latest steps, for profiles

    def stats(self) -> dict:
        t = self._spec_totals
        out = {
            "rollout/spec_accept_rate": t.accepted_tokens / t.draft_tokens if t.draft_tokens else 0.0,
            "rollout/spec_accept_length": t.accept_length,
            "rollout/spec_draft_tokens": t.draft_tokens,
            "rollout/spec_accepted_tokens": t.accepted_tokens,
            "rollout/spec_verify_steps": t.verify_steps,
            "rollout/spec_emitted_tokens": t.emitted_tokens,
            "rollout/tokens_per_s": self.tokens_per_s,
            "rollout/output_tokens": self._output_tokens,
            "rollout/steps": self._steps,
            "rollout/draft_steps": self._draft_steps,
            "rollout/weight_version": self.weight_version,
            "rollout/weight_sync_s": self._weight_sync_s,
            "rollout/num_running": len(self.scheduler.running),
            "rollout/num_waiting": len(self.scheduler.waiting),
            "rollout/kv_usage": self.pool.used_slots / (self.pool.num_slots - 1),
            "rollout/num_preempted": self.scheduler.num_preempted,
            "rollout/num_overflowed": self.emitter.overflowed,  # samples aborted because a forward overflowed
        }
        out.update(self.spec.stats())
        for source, c in t.by_source.items():
            out[f"rollout/spec_draft_tokens/{source}"] = c["draft_tokens"]
            out[f"rollout/spec_accepted_tokens/{source}"] = c["accepted_tokens"]
            out[f"rollout/spec_accept_rate/{source}"] = (
                c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0
            )
        return out


def overflow_message(dtype: torch.dtype) -> str:
    """Why a request whose forward overflowed ended (SGLang's abort message)."""
    name = str(dtype).removeprefix("torch.")
    why = (f"the forward pass overflowed {name} (an inf or NaN in the hidden state or the logits)")
    if dtype == torch.float16:
        return (f"{why}: this model's activations exceed float16's range (65,504); serve it in bfloat16 "
                "(--dtype bfloat16), or push weights that keep it in range. No token of the failed step was returned")
    return f"{why}: its weights may be broken (push sane ones). No token of the failed step was returned"


def _without_finished(batch: Batch | None) -> Batch | None:
    """A batch scheduled before the step in flight completed, less the sequences that stopped in it."""
    if batch is None:
        return None
    if batch.is_prefill:
        items = [item for item in batch.items if not item.seq.finished]
        return Batch.prefill(items) if items else None
    if not any(seq.finished for seq in batch.seqs):
        return batch
    seqs = [seq for seq in batch.seqs if not seq.finished]
    return Batch(seqs) if seqs else None
