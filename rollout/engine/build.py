"""An engine's parts, built from its config on one rank: the model (this rank's shard, loaded or
random), a draft head, the KV pool, the attention backend, the token table, speculation, and the
runner with its CUDA graphs. `Engine` (rollout/engine/engine.py) holds them and steps them.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from kernels import pdl
from kernels.attention import AttentionBackend
from rollout.config import EngineConfig
from rollout.engine.kv_pool import KVPool
from rollout.engine.model_runner import ModelRunner
from rollout.engine.tensor_parallel import Follower, Leader
from rollout.models.config import ModelConfig
from rollout.models.llama import CausalLM
from rollout.models.loader import build_model, load_checkpoint, randomize
from rollout.models.sharding import Shard
from spec.draft_head import load_head, load_mtp
from spec.drafters import DraftOrder
from spec.head_drafter import HeadDrafter
from spec.speculator import Speculator
from spec.token_table import TokenTable

log = logging.getLogger("rollout")

DEFAULT_CPU_KV_TOKENS = 16384
DEFAULT_PREFILL_TOKENS = 4096
DEFAULT_CPU_PREFILL_TOKENS = 512  # a step's prompt tokens on the CPU: 4,096 of the default model's take ~20 s
DEFAULT_MAX_MODEL_LEN = 8192
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@dataclass
class Parts:
    dtype: torch.dtype
    shard: Shard
    tokenizer: object
    max_model_len: int
    max_prefill_tokens: int
    eos_token_ids: set[int]
    model: CausalLM
    pool: KVPool
    table: TokenTable
    spec: Speculator
    runner: ModelRunner


SHARED_FIELDS = ("model", "dtype", "device", "load_format", "seed", "tp_size", "batch_invariant", "enable_fp32_residual",
                 "enable_fp32_lm_head", "enable_fp32_activations")  # what engines serving one model object must agree on


def check_shareable(cfg: EngineConfig, other: EngineConfig) -> None:
    """Engines of one process may serve one model object (a benchmark's engine per speculation mode
    on a model too large to hold twice) when nothing they would do to its weights differs. They
    share its weight updates too, and neither can release its memory (rollout/engine/memory.py)."""
    differ = [f for f in SHARED_FIELDS if getattr(cfg, f) != getattr(other, f)]
    if differ or cfg.tp_size > 1:
        why = f"they differ in {', '.join(differ)}" if differ else "tensor parallelism holds the weights in rank processes"
        raise ValueError(f"share_weights_with: these engines cannot serve one model ({why})")


def served_model(cfg: EngineConfig, model_config: ModelConfig, model_path: Path, device: torch.device,
                 dtype: torch.dtype, shard: Shard, shared=None) -> CausalLM:
    """The model this rank serves: built and loaded (or randomised), or `shared`'s (an Engine's)."""
    if shared is not None:
        check_shareable(cfg, shared.config)
        shared.model.shared = True
        return shared.model
    model = build_model(model_config, device, dtype, shard)
    if cfg.load_format == "dummy":
        randomize(model, cfg.seed + shard.rank)
    else:
        load_checkpoint(model, model_path)
    return model


def build_parts(cfg: EngineConfig, device: torch.device, tp: Leader | Follower | None, model_path: Path,
                model_config: ModelConfig, shared=None) -> Parts:
    """Everything a rank steps with (`tp`: its group under tensor parallelism, else None);
    `shared`: an Engine whose model this one serves too (check_shareable)."""
    dtype = resolve_dtype(cfg.dtype, device)
    shard = Shard(tp.rank if tp is not None else 0, cfg.tp_size, tp.group if tp is not None else None)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    max_model_len = cfg.max_model_len or min(model_config.max_context, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_config.max_context:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_config.max_context}")

    pdl.set_enabled(cfg.pdl and pdl.supported(device))  # before any kernel is timed or captured
    model = served_model(cfg, model_config, model_path, device, dtype, shard, shared)
    head = draft_head(cfg, model_path, model_config, dtype, shard, device)
    layers = model_config.num_layers + (head is not None)  # the head's KV: one more layer
    pool = KVPool(
        num_layers=layers,
        num_slots=kv_cache_tokens(cfg, model_config, layers, shard, dtype, device, tp),
        num_kv_heads=shard.kv_heads(model_config),
        head_dim=model_config.head_dim,
        dtype=dtype,
        device=device,
        max_rows=cfg.max_running_seqs,
        # a verify step may overhang a sequence's end, and one more may be launched before it is
        # collected; a draft head's rows stand past the end (spec/head_drafter.py)
        max_context=max_model_len + 2 * (cfg.spec.max_draft_tokens + 1) + 1 + cfg.spec.head_rows,
        reserved=0 if head is None else (cfg.max_running_seqs + 1) * HeadDrafter.scratch_per_row(
            cfg.spec.head_depth, cfg.spec.head_topk),
    )
    backend_name = cfg.attention_backend
    if backend_name == "auto":
        backend_name = "triton" if device.type == "cuda" else "torch"
    # deterministic inference (and coupled sampling) computes a token alike in any step (a decode row, a verify chain)
    if cfg.batch_invariant:
        model.make_batch_invariant()
    model.keep_float32(residual=cfg.enable_fp32_residual, lm_head=cfg.enable_fp32_lm_head,
                       activations=cfg.enable_fp32_activations)
    backend = attention_backend(backend_name, device, cfg.batch_invariant)
    history = cfg.spec.history_rows if cfg.spec.enabled else 0
    table = TokenTable(cfg.max_running_seqs, history, pool.max_context, device)
    spec = Speculator(cfg.spec, table, chains=cfg.batch_invariant, coupled=cfg.coupled_sampling)
    eagle = None if head is None else HeadDrafter(head, model, pool, cfg.spec.head_depth, cfg.spec.head_topk,
                                                   cfg.spec.head_nodes, cfg.max_running_seqs)
    runner = ModelRunner(model, pool, table, backend, device, DraftOrder(spec.draft, eagle))
    if cfg.cuda_graphs and device.type == "cuda" and backend_name == "triton":
        capture_graphs(cfg, runner, spec, shard.heads(model_config), dtype)

    eos_token_ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_token_ids.add(tokenizer.eos_token_id)
    max_prefill_tokens = cfg.max_prefill_tokens or (DEFAULT_PREFILL_TOKENS if device.type == "cuda"
                                                    else DEFAULT_CPU_PREFILL_TOKENS)
    return Parts(dtype, shard, tokenizer, max_model_len, max_prefill_tokens,
                 eos_token_ids, model, pool, table, spec, runner)


def draft_head(cfg: EngineConfig, model_path: Path, model_config: ModelConfig, dtype: torch.dtype, shard: Shard,
               device: torch.device):
    """The draft head the config asks for, on `device`: the model's own MTP layer, an EAGLE head, or None."""
    head = None
    if "mtp" in cfg.spec.drafters:
        head = load_mtp(model_path, model_config, layer=model_config.num_layers, dtype=dtype, shard=shard)
    elif "eagle" in cfg.spec.drafters:
        head = load_head(cfg.spec.draft_model, model_config, layer=model_config.num_layers, dtype=dtype, shard=shard)
    return None if head is None else head.to(device)


def capture_graphs(cfg: EngineConfig, runner: ModelRunner, spec: Speculator, heads: int, dtype: torch.dtype) -> None:
    """A CUDA graph of every decode-step shape the engine can ask for (rollout/engine/cuda_graphs.py)
    and of small one-sequence prefill steps (rollout/engine/prefill_graphs.py);
    with a draft head, what its work costs a step against what it drafts (spec/head_watch.py HeadCycle)."""
    max_tokens = max(cfg.max_running_seqs, cfg.spec.max_verify_tokens if cfg.spec.enabled else 0)
    capacities = spec.budget.capacities if cfg.spec.enabled else (lambda b: [0])
    attn_out = torch.zeros(max_tokens, heads, runner.model.config.head_dim, dtype=dtype, device=runner.device)
    t0 = time.perf_counter()
    count = runner.capture_graphs(attn_out, cfg.max_running_seqs, capacities, spec.step_kinds)
    count += runner.capture_prefill_graphs(heads)
    log.info("captured %d CUDA graphs in %.1f s", count, time.perf_counter() - t0)
    if runner.drafters.head is not None:
        spec.cycle.costs = runner.graphs.head_costs()
        log.info("draft head's pass and tree, ms by batch bucket: %s", {
            b: (round(p * 1e3, 3), round(t * 1e3, 3)) for b, (p, t) in spec.cycle.costs.items()})


def kv_cache_tokens(cfg: EngineConfig, mc: ModelConfig, layers: int, shard: Shard, dtype: torch.dtype,
                    device: torch.device, tp: Leader | Follower | None) -> int:
    """The KV pool's slots (one more than its tokens: slot 0 is padding's): as configured, or the
    share of free GPU memory the config gives it over `layers` (a draft head's included), the
    smallest any rank can hold."""
    if cfg.kv_cache_tokens:
        return cfg.kv_cache_tokens + 1
    if device.type != "cuda":
        return DEFAULT_CPU_KV_TOKENS + 1
    per_token = 2 * layers * shard.kv_heads(mc) * mc.head_dim * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    slots = int(free * cfg.kv_cache_memory_fraction) // per_token
    return slots if tp is None else tp.group.minimum(slots)  # every rank schedules alike


def resolve_device(name: str, gpu: int = 0) -> torch.device:
    """`auto` and `cuda` mean GPU `gpu` (EngineConfig.base_gpu_id) when there is one; `cuda:N` is GPU N."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for but no CUDA GPU is available; use device='cpu' or 'auto'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # always an explicit GPU, for set_device and friends
        device = torch.device("cuda", gpu)
    return device


def keep_host_heap() -> None:
    """glibc's malloc, in a process that runs an engine on the CPU: large blocks come from the heap rather than fresh
    mappings, and the heap's free top is kept. A CPU step's large temporaries (which ones was not traced) were
    otherwise mapped, faulted in page by page and unmapped at every step: 24.7 million minor faults (~1 GB a step)
    in a rollout of 2,487 tokens of the default model, at 49.5 tokens/s against 89.1 with the heap kept
    (bench/results/session-20261128b/cpu-heap-*.log). The process then holds its peak memory, as a caching allocator
    would. Without glibc (musl, macOS) nothing changes."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, -1)  # (never trim)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)  # one of EngineConfig.dtype's choices


def attention_backend(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    """`torch` (the reference, any device; batch-invariant as it is) or `triton` (CUDA); Triton is
    imported only when chosen."""
    if name == "torch":
        from kernels.torch_attention import TorchAttention

        return TorchAttention()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device; use --attention-backend torch on CPU")
        from kernels.triton_attention import TritonAttention

        return TritonAttention(batch_invariant=batch_invariant)
    raise ValueError(f"attention backend {name!r}: choose torch or triton")
