"""User-facing knobs: one dataclass for a request's sampling, one for the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    """Per-request sampling; names follow SGLang's `sampling_params`.

    Logprobs are those of the distribution each token was drawn from: softmax(logits / T)
    restricted to the top-k / top-p / min-p set and renormalized; raw log-softmax for greedy.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"sampling_params.{name} {why} (got {getattr(self, name)!r})")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not self.temperature >= 0:
            fail("temperature", "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be -1 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            fail("max_new_tokens", "must be an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, raw: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**raw)


@dataclass
class SpecConfig:
    """Speculation knobs; defaults suit a single GPU and the CPU alike."""

    method: str = "auto"  # off | ngram | auto (auto = the best drafter the model allows; today ngram)
    max_draft_tokens: int = 8  # per request per step (tree nodes beyond the root), at most 63
    max_verify_tokens: int = 256  # per step over the whole batch; speculation shrinks as the batch grows
    min_match: int = 1
    max_match: int = 6
    max_trie_nodes: int = 4_000_000  # ~270 bytes each: about 1 GB at the limit
    share_siblings: bool = True
    adaptive: bool = True  # learn when drafting pays (spec/budget.py); off: every sequence drafts its cap each step

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram", "auto"):
            raise ValueError(f"spec {self.method!r} is not available: choose off, ngram or auto")
        if not 0 <= self.max_draft_tokens <= 63:
            raise ValueError("spec max_draft_tokens must be in [0, 63] (trees hold at most 64 tokens)")

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.max_draft_tokens > 0


@dataclass
class EngineConfig:
    model: str = "default"
    load_format: str = "auto"  # auto | dummy (random weights, for speed work on shapes without a checkpoint)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # auto = triton on CUDA, torch elsewhere
    max_model_len: int | None = None  # default: the model's context, capped at 8192
    max_running_seqs: int = 256
    max_prefill_tokens: int = 4096  # tokens per step across prefill chunks
    kv_cache_tokens: int | None = None  # default: from kv_cache_memory_fraction (CUDA) or 64k tokens (CPU)
    kv_cache_memory_fraction: float = 0.85
    cuda_graphs: bool = True
    overlap_schedule: bool = True  # launch each decode step before the host has the previous step's tokens
    pdl: bool = True  # programmatic dependent launch of the Triton kernels on Hopper (kernels/pdl.py); process-wide
    seed: int = 0
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if isinstance(self.spec, str):
            self.spec = SpecConfig(method=self.spec)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r}: choose auto, cpu or cuda")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {self.load_format!r}: choose auto or dummy")
        if self.max_running_seqs < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running_seqs and max_prefill_tokens must be >= 1")
