"""The engine: requests in, tokens out, one `step()` at a time.

`generate()` is the synchronous front door; the server drives `add_request`/`step`/`abort`
itself. Each step: the scheduler picks the batch, speculation picks its draft rows (spec/), the
runner drafts, computes and verifies on the device, and the engine appends what was
emitted, applying stop conditions token by token so that speculation never changes the output.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import AutoTokenizer

from kernels import pdl
from kernels.attention import AttentionBackend
from rollout.config import MAX_TOP_LOGPROBS, MEMORY_TAGS, EngineConfig, SamplingParams, SpecConfig, request_limit
from rollout.engine.detokenizer import final_text
from rollout.engine.kv_pool import KVPool
from rollout.engine.model_runner import ModelRunner
from rollout.engine.sampler import prompt_seed, sequence_key
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Request, Sequence, SpecCounters, Status
from rollout.engine.step import Batch, Emitted, HeadWork, StepInFlight, StepRecord
from rollout.engine.tensor_parallel import start_ranks
from rollout.engine.token_table import TokenTable
from rollout.models.config import ModelConfig
from rollout.models.loader import (
    build_model,
    load_checkpoint,
    randomize,
    resolve_model_path,
)
from rollout.models.sharding import Shard
from rollout.models.weights import (
    check_weights,
    checkpoint_specs,
    copy_weights,
    iter_checkpoint,
)
from spec.draft_head import load_head, load_mtp
from spec.budget import StepPlan
from spec.eagle import EagleDrafter
from spec.speculator import Speculator

log = logging.getLogger("rollout")

HEAD_PREFIX = "draft."  # a draft head's tensors in a weight push: its checkpoint names after this

DEFAULT_CPU_KV_TOKENS = 16384
DEFAULT_PREFILL_TOKENS = 4096
DEFAULT_CPU_PREFILL_TOKENS = 512  # a step's prompt tokens on the CPU: 4,096 of the default model's take ~20 s
DEFAULT_MAX_MODEL_LEN = 8192
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


@dataclass
class Output:
    """One sample of one prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str  # stop | length | abort
    matched_stop: int | str | None
    weight_versions: list[int]
    spec: dict
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV this sample took from its request's prefill (its forks')
    top_logprobs: list[tuple[list[int], list[float]]] | None = field(default=None, repr=False)  # per token, if asked


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
        rank = tp_follower[0] if tp_follower is not None else 0
        self.device = _resolve_device(cfg.device, cfg.base_gpu_id + rank)
        if self.device.type == "cuda":  # Triton launches and graph captures go to the current GPU: make it ours
            torch.cuda.set_device(self.device)
        self.dtype = _resolve_dtype(cfg.dtype, self.device)
        self.model_path = resolve_model_path(cfg.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        Shard.check(self.model_config, cfg.tp_size)
        self.tp = start_ranks(cfg, self.device, tp_follower, tp_hooks)  # None with one rank
        if self.tp is not None and self.device.type == "cpu":  # ranks that share the cores: no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tp_size))
        self.shard = Shard(rank, cfg.tp_size, self.tp.group if self.tp is not None else None)
        self.staged_weights = None  # a rank > 0's own copy of a pushed update, by version (set by its server)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.max_model_len = cfg.max_model_len or min(self.model_config.max_context, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > self.model_config.max_context:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {self.model_config.max_context}")

        pdl.set_enabled(cfg.pdl and pdl.supported(self.device))  # before any kernel is timed or captured
        self.model = build_model(self.model_config, self.device, self.dtype, self.shard)
        if cfg.load_format == "dummy":
            randomize(self.model, cfg.seed + rank)
        else:
            load_checkpoint(self.model, self.model_path)
        head = None
        if "mtp" in cfg.spec.drafters:
            head = load_mtp(self.model_path, self.model_config, layer=self.model_config.num_layers, dtype=self.dtype)
            head.to(self.device)
        elif "eagle" in cfg.spec.drafters:
            head = load_head(cfg.spec.draft_model, self.model_config, layer=self.model_config.num_layers, dtype=self.dtype)
            head.to(self.device)
        self.pool = KVPool(
            num_layers=self.model_config.num_layers + (head is not None),  # the head's KV: one more layer
            num_slots=self._kv_cache_tokens(),
            num_kv_heads=self.shard.kv_heads(self.model_config),
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_rows=cfg.max_running_seqs,
            # a verify step may overhang a sequence's end, and one more may be launched before it is
            # collected; a draft head's rows stand past the end (spec/eagle.py)
            max_context=self.max_model_len + 2 * (cfg.spec.max_draft_tokens + 1) + 1
            + cfg.spec.head_rows,
            reserved=0 if head is None else (cfg.max_running_seqs + 1) * EagleDrafter.scratch_per_row(
                cfg.spec.head_depth, cfg.spec.head_topk),
        )
        backend_name = cfg.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        self.backend = attention_backend(backend_name, self.device)
        history = cfg.spec.history_rows if cfg.spec.enabled else 0
        self.table = TokenTable(cfg.max_running_seqs, history, self.pool.max_context, self.device)
        self._build_speculation()
        self.runner = ModelRunner(self.model, self.pool, self.table, self.backend, self.device, self.spec.draft)
        if head is not None:
            self.runner.eagle = EagleDrafter(head, self.model, self.pool, cfg.spec.head_depth, cfg.spec.head_topk,
                                             cfg.spec.head_nodes, cfg.max_running_seqs)
        self.max_prefill_tokens = cfg.max_prefill_tokens or (DEFAULT_PREFILL_TOKENS if self.device.type == "cuda"
                                                             else DEFAULT_CPU_PREFILL_TOKENS)
        self.scheduler = Scheduler(self.pool, cfg.max_running_seqs, self.max_prefill_tokens, self._released)
        if cfg.cuda_graphs and self.device.type == "cuda" and backend_name == "triton":
            from rollout.engine.cuda_graphs import CudaGraphs

            max_tokens = max(cfg.max_running_seqs, cfg.spec.max_verify_tokens if cfg.spec.enabled else 0)
            capacities = self.spec.budget.capacities if cfg.spec.enabled else (lambda b: [0])
            mc = self.model_config
            attn_out = torch.zeros(max_tokens, self.shard.heads(mc), mc.head_dim, dtype=self.dtype, device=self.device)
            self.runner.graphs = CudaGraphs(self.runner.run_decode, attn_out, self.table.padding_row,
                                            cfg.max_running_seqs, capacities, self.spec.step_kinds)
            t0 = time.perf_counter()
            count = self.runner.graphs.capture_all()
            log.info("captured %d CUDA graphs in %.1f s", count, time.perf_counter() - t0)
            if self.runner.eagle is not None:  # what the head's work costs a step, against what it drafts (HeadCycle)
                self.spec.cycle.costs = self.runner.graphs.head_costs()
                log.info("draft head's pass and tree, ms by batch bucket: %s", {
                    b: (round(p * 1e3, 3), round(t * 1e3, 3)) for b, (p, t) in self.spec.cycle.costs.items()})

        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
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
        self.released: set[str] = set()  # memory let go by release_memory: nothing runs until it is back
        self.reset_stats()

    def _build_speculation(self) -> None:
        self.spec = Speculator(self.config.spec, self.table, coupled=self.config.coupled_sampling)
        if hasattr(self, "runner"):
            self.runner.draft = self.spec.draft

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
        self.scheduler = Scheduler(self.pool, self.config.max_running_seqs, self.max_prefill_tokens, self._released)
        self._build_speculation()  # (its history too: it may hold what broke the step)
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
            params = SamplingParams.from_dict(params)
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
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        if self.tp is not None and self.tp.leads:
            self.tp.close()

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
            launched = self._launch(batch, began)
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

    def _launch(self, batch: Batch, began: float) -> StepInFlight:
        if batch.is_prefill:
            slots, positions, starts = self.scheduler.place_prefill(batch)
            head = self.spec.head_for_prefill(new_prompts=bool((starts == 0).any()))
            self._flush_replay()
            step = self.runner.launch_prefill(batch, slots, positions, starts, head)
        else:
            plan = self._plan(len(batch.seqs))
            self.spec.before_decode(plan.drafting)
            self._draft_steps += plan.draft_rows > 0
            slots = self.scheduler.step_slots(len(batch.seqs) + plan.draft_rows)
            self._flush_replay()
            step = self.runner.launch_decode(batch, slots, plan.draft_rows, plan.drafting, plan.head, plan.shadow)
        step.began = began
        return step

    def _plan(self, num_seqs: int) -> StepPlan:
        """The decode step's plan: the budget's, which weighs this process's measured step times,
        so under tensor parallelism rank 0's, sent before the step's collectives."""
        if self.tp is not None and not self.tp.leads:
            draft_rows, drafting, shadow, head = self.tp.expect("plan")
            return StepPlan(draft_rows, drafting, shadow, HeadWork(head))
        plan = self.spec.plan(num_seqs, self.scheduler.free_slots, draining=not self.scheduler.waiting)
        if self.tp is not None:
            self.tp.record("plan", plan.draft_rows, plan.drafting, plan.shadow, int(plan.head))
        return plan

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
        self.step_log.append(StepRecord(len(seqs), step.draft_rows, prefill, cost * 1e3, device_s * 1e3, host_s * 1e3))
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
        """Append what a step emitted, up to each sequence's stop condition; a sequence that stopped
        while the step ran takes none. Returns the tokens appended, and the draft head's accepted
        drafts among them. (Runs for every sequence of every step: it is kept lean, and a
        sequence that cannot stop in this step takes its tokens in three list extends.)"""
        version, top = self.weight_version, e.top
        totals = self._spec_totals
        # the step's totals, recorded once after the loop (a call per sequence costs ~1 us at 512 of them)
        appended_all = plain = plain_appended = 0
        by_source: dict[str, list[int]] = {}  # drafter -> drafts, accepted, appended, sequences, first drafts accepted
        for i, (seq, tokens, logprobs, drafted, counted) in enumerate(
                zip(e.seqs, e.tokens, e.logprobs, e.drafted, e.counted)):
            if seq.finish_reason is not None:  # (Sequence.finished, without the call)
                continue
            req = seq.request
            updated[id(req)] = req
            k = len(tokens)
            if req.plain and len(seq.tokens) + k < req.max_len and req.stop_ids.isdisjoint(tokens):
                seq.tokens += tokens
                seq.logprobs += logprobs
                seq.weight_versions += [version] * k
                reason = None
            else:
                k, reason = self._append_checked(seq, tokens, logprobs, version)
            if top is not None:
                seq.top_logprobs.extend(top[i][:k])
            appended_all += k
            if drafted:
                source = e.sources[i]
                seq.spec.record(source, drafted, len(tokens) - 1, k)
                t = by_source.get(source) or by_source.setdefault(source, [0, 0, 0, 0, 0])
                t[0] += drafted
                t[1] += len(tokens) - 1
                t[2] += k
                t[3] += 1
                t[4] += len(tokens) > 1
            elif counted:  # a step without drafts: what SpecCounters.record does for it, inline
                spec = seq.spec
                spec.verify_steps += 1
                spec.emitted_tokens += k
                plain += 1
                plain_appended += k
            if reason is not None:
                self._finish(seq, reason)
        self._output_tokens += appended_all
        totals.verify_steps += plain
        totals.emitted_tokens += plain_appended
        for source, (drafts, accepted, appended, seqs, _) in by_source.items():
            totals.record(source, drafts, accepted, appended, steps=seqs)
        head = by_source.get(self.runner.eagle.source) if self.runner.eagle is not None else None
        if head is not None:
            self.spec.observe_head(head[3], head[4])
        return appended_all, head[1] if head is not None else 0

    def _append_checked(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int) -> tuple[int, str | None]:
        """Append token by token while no stop condition holds: (tokens appended, why it stopped or None)."""
        req = seq.request
        reason, appended = None, 0
        for token, logprob in zip(tokens, logprobs):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.weight_versions.append(version)
            appended += 1
            reason = self._stop_reason(seq, token, req)
            if reason is not None:
                break
        if req.edits_logits:
            counts = seq.output_counts
            for token in tokens[:appended]:
                counts[token] = counts.get(token, 0) + 1
        return appended, reason

    def _stop_reason(self, seq: Sequence, token: int, req: Request) -> str | None:
        if seq.num_output >= req.params.min_new_tokens:
            if token in req.stop_ids:
                seq.matched_stop = token
                return "stop"
            stop = req.params.stop
            if stop:
                window = max(len(s) for s in stop) + 2
                tail = self.tokenizer.decode(seq.output_ids[-window:])
                hit = next((s for s in stop if s in tail), None)
                if hit is not None:
                    seq.matched_stop = hit
                    return "stop"
        if len(seq.tokens) >= req.max_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
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
        text = final_text(self.tokenizer, seq.output_ids, seq.matched_stop, seq.request.params)
        return Output(
            token_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs) if seq.request.return_logprob else None,
            text=text,
            finish_reason=seq.finish_reason or "abort",
            matched_stop=seq.matched_stop,
            weight_versions=list(seq.weight_versions),
            spec=seq.spec.as_dict(),
            prompt_tokens=seq.num_prompt,
            cached_tokens=seq.cached_tokens,
            top_logprobs=list(seq.top_logprobs) if seq.request.top_logprobs_num else None,
        )

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
        if self.runner.eagle is not None:
            targets.update({HEAD_PREFIX + n: t for n, t in self.runner.eagle.head.weight_targets().items()})
        return targets

    def _set_version(self, version: int | None) -> None:
        version = self.weight_version + 1 if version is None else int(version)
        if version <= self.weight_version:
            log.warning("weight version %d is not above the current %d", version, self.weight_version)
        self.weight_version = version

    # ---------------- memory (a colocated trainer's turn on the GPU) ----------------
    def release_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Let go of GPU memory while no sequence holds KV: `kv_cache` (the KV pool), `weights` (moved
        to pinned host memory), `cuda_graph` (the captured graphs and their pool; releasing either of
        the others drops them too, as they hold those addresses). None: all. Nothing runs until all
        is back; requests that arrive meanwhile wait."""
        tags = _memory_tags(tags)
        if self.pool.used_slots:
            raise MemoryStateError(f"{len(self.scheduler.running)} sequence(s) hold KV cache: abort them or wait "
                                   "(pause_generation) before releasing memory")
        self._replay("release_memory", sorted(tags))
        if self.runner.graphs is None:
            tags.discard("cuda_graph")
        before = _device_bytes(self.device)
        new = tags - self.released
        if new:
            self.runner.drop_graphs()
        if "kv_cache" in new:
            self.pool.free_memory()
        if "weights" in new:
            self.model.to_host()
        self.released |= tags
        _empty_device_cache(self.device)
        return {"released": sorted(self.released), "freed_bytes": before - _device_bytes(self.device)}

    def resume_memory(self, tags: Iterable[str] | None = None) -> dict:
        """Take back what `release_memory` let go (None: all); graphs are captured again once nothing
        is released any more."""
        tags = _memory_tags(tags) & self.released
        self._replay("resume_memory", sorted(tags))
        self._flush_replay()  # (graphs are captured again: collectives)
        before = _device_bytes(self.device)
        if "weights" in tags:
            self.model.to(self.device)
        if "kv_cache" in tags:
            self.pool.allocate()
        self.released -= tags
        graphs = self.runner.graphs
        if not self.released and graphs is not None and not graphs.captured:
            graphs.capture_all()
        return {"released": sorted(self.released), "allocated_bytes": _device_bytes(self.device) - before}

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
        }
        out.update(self.spec.stats())
        for source, c in t.by_source.items():
            out[f"rollout/spec_draft_tokens/{source}"] = c["draft_tokens"]
            out[f"rollout/spec_accepted_tokens/{source}"] = c["accepted_tokens"]
            out[f"rollout/spec_accept_rate/{source}"] = (
                c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0
            )
        return out

    def _kv_cache_tokens(self) -> int:
        if self.config.kv_cache_tokens:
            return self.config.kv_cache_tokens + 1
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS + 1
        c = self.model_config
        per_token = 2 * c.num_layers * self.shard.kv_heads(c) * c.head_dim * self.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        slots = int(free * self.config.kv_cache_memory_fraction) // per_token
        return slots if self.tp is None else self.tp.group.minimum(slots)  # every rank schedules alike


class MemoryStateError(RuntimeError):
    """Memory cannot be released now (requests in flight); the HTTP answer is 409."""

    status = 409


def _memory_tags(tags: Iterable[str] | None) -> set[str]:
    tags = set(MEMORY_TAGS if tags is None else tags)
    unknown = tags - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tag(s) {sorted(unknown)}: choose from {', '.join(MEMORY_TAGS)}")
    return tags


def _device_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


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


def _resolve_device(name: str, gpu: int = 0) -> torch.device:
    """`auto` and `cuda` mean GPU `gpu` (EngineConfig.base_gpu_id) when there is one; `cuda:N` is GPU N."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for but no CUDA GPU is available; use device='cpu' or 'auto'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # always an explicit GPU, for set_device and friends
        device = torch.device("cuda", gpu)
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)  # one of EngineConfig.dtype's choices


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch` (the reference, any device) or `triton` (CUDA); Triton is imported only when chosen."""
    if name == "torch":
        from kernels.torch_attention import TorchAttention

        return TorchAttention()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device; use --attention-backend torch on CPU")
        from kernels.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention backend {name!r}: choose torch or triton")
