"""User-facing knobs: one dataclass for a request's sampling, one for the engine."""

from __future__ import annotations

import argparse
import math
import os
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

DEFAULT_HEAD = Path(__file__).parent / "models" / "default_head"  # recipes/train_eagle.py's EAGLE-3 head for the default model
INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # the most likely tokens reported per output token, at most (as OpenAI's API)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # what release_memory lets go, by SGLang's names
GREEDY_BELOW = 1e-6  # a temperature below this is greedy (SGLang's rule): logits / T would overflow


def param(default, json: str, help: str, **kw):
    """A SamplingParams field: its JSON kind (`int`, `number`, `flag`, `strings`, `ids`, `bias`),
    which the HTTP front end checks (rollout.server.guard), and its help, which `rollout generate`'s
    flags show (`SamplingParams.add_args`): the one list of sampling parameters and their defaults."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"json": json, "help": help, **kw})
    return field(default=default, metadata={"json": json, "help": help, **kw})


@dataclass
class SamplingParams:
    """Per-request sampling; names and meanings follow SGLang's `sampling_params`.

    Logits are processed in this order: repetition penalty (prompt and output tokens; a
    positive logit is divided by it, a negative one multiplied), frequency and presence
    penalties (output tokens), logit bias, and until `min_new_tokens` are out the stop
    tokens are banned; then temperature and top-k / top-p / min-p. Logprobs are those of
    the distribution each token was drawn from, after all of that; raw log-softmax (of the
    processed logits) for greedy.
    """

    n: int = param(1, "int", "samples of the prompt")
    temperature: float = param(1.0, "number", "0 = greedy")
    top_p: float = param(1.0, "number", "nucleus: the likeliest tokens whose mass reaches this, in (0, 1]")
    top_k: int = param(-1, "int", "the k likeliest tokens (-1 or 0: off)")
    min_p: float = param(0.0, "number", "tokens at least this share of the likeliest one's probability")
    max_new_tokens: int = param(128, "int", "new tokens at most")
    min_new_tokens: int = param(0, "int", "no stop (token or string) ends a sample before this many tokens")
    stop: list[str] | str | None = param(None, "strings", "a string that ends a sample (repeatable)")
    stop_token_ids: list[int] | None = param(None, "ids", "a token id that ends a sample (repeatable)")
    seed: int | None = param(None, "int", "the request's seed (sample i draws with a key of it and i)", flag="sample-seed")
    ignore_eos: bool = param(False, "flag", "keep going past the end-of-sequence token")
    frequency_penalty: float = param(0.0, "number", "[-2, 2], times each output token's count")
    presence_penalty: float = param(0.0, "number", "[-2, 2], once for every token in the output")
    repetition_penalty: float = param(1.0, "number", "(0, 2], for every token in the prompt or the output")
    logit_bias: dict[int, float] | None = param(None, "bias", "token id -> added to its logit, in [-100, 100]", flag=None)
    skip_special_tokens: bool = param(True, "flag", "leave special tokens out of the text")
    spaces_between_special_tokens: bool = param(True, "flag", "put spaces between special tokens in the text")
    no_stop_trim: bool = param(False, "flag", "keep a matched stop string at the end of the text")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.logit_bias = self.logit_bias or None
        self.validate()
        if 0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"sampling_params.{name} {why} (got {getattr(self, name)!r})")

        def integer(name: str, low: int, high: int = INT64_MAX) -> None:
            v = getattr(self, name)
            if not _is_int(v) or not low <= v <= high:
                fail(name, f"must be an integer in [{low}, {high}]")

        def number(name: str, ok) -> bool:
            v = getattr(self, name)
            return _is_number(v) and ok(v)

        integer("n", 1)
        if not number("temperature", lambda t: t >= 0):
            fail("temperature", "must be a number >= 0 (0 = greedy)")
        if not number("top_p", lambda p: 0 < p <= 1):
            fail("top_p", "must be in (0, 1]")
        integer("top_k", -1)
        if not number("min_p", lambda p: 0 <= p <= 1):
            fail("min_p", "must be in [0, 1]")
        integer("max_new_tokens", 1)
        integer("min_new_tokens", 0, self.max_new_tokens if _is_int(self.max_new_tokens) else INT64_MAX)
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of them")
        if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed <= INT64_MAX):
            fail("seed", "must be a 64-bit integer")
        for name in ("frequency_penalty", "presence_penalty"):
            if not number(name, lambda p: -2 <= p <= 2):
                fail(name, "must be in [-2, 2]")
        if not number("repetition_penalty", lambda p: 0 < p <= 2):
            fail("repetition_penalty", "must be in (0, 2]")
        for token, bias in (self.logit_bias or {}).items():
            if not (0 <= token <= INT64_MAX and _is_number(bias) and -100 <= bias <= 100):
                fail("logit_bias", "must map token ids to numbers in [-100, 100]")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether logits are edited before sampling (penalties, bias, min_new_tokens)."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
            or self.logit_bias or self.min_new_tokens
        )

    @classmethod
    def from_dict(cls, raw: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**raw)

    @classmethod
    def validated(cls, raw: dict) -> "SamplingParams":
        """Params from the fields of ones already validated (`dataclasses.asdict` of them, through JSON:
        another rank's), not checked again."""
        params = object.__new__(cls)
        params.__dict__.update(raw)
        if params.logit_bias:  # (JSON object keys are strings)
            params.logit_bias = {int(k): v for k, v in params.logit_bias.items()}
        return params

    @staticmethod
    def add_args(group) -> None:
        """`rollout generate`'s sampling flags, one a field (`--<name>`, `--no-<name>` for a flag that is on;
        stored as `sampling_<name>`, apart from the engine's flags)."""
        for f in fields(SamplingParams):
            flag = f.metadata.get("flag", f.name.replace("_", "-"))
            if flag is None:
                continue
            default, kind, dest = f.default, f.metadata["json"], f"sampling_{f.name}"
            if kind == "flag":
                group.add_argument(f"--no-{flag}" if default else f"--{flag}", dest=dest,
                                   action="store_false" if default else "store_true",
                                   help=f"do not {f.metadata['help']}" if default else f.metadata["help"])
            elif kind in ("strings", "ids"):
                group.add_argument(f"--{flag}", dest=dest, action="append", type=str if kind == "strings" else int,
                                   metavar=f.name.upper(), help=f.metadata["help"])
            else:
                group.add_argument(f"--{flag}", dest=dest, type=int if kind == "int" else float, default=default,
                                   metavar=f.name.upper(), help=f"{f.metadata['help']} (default: {default})")

    @staticmethod
    def from_args(args: argparse.Namespace) -> "SamplingParams":
        return SamplingParams(**{f.name: getattr(args, f"sampling_{f.name}") for f in fields(SamplingParams)
                                 if hasattr(args, f"sampling_{f.name}")})


def request_limit(prompt_len: int, params: SamplingParams, max_model_len: int, max_running_seqs: int,
                  kv_tokens: int) -> tuple[str, str] | None:
    """The first of an engine's limits a request breaks, as (`n` | `prompt` | `max_new_tokens`, why),
    or None if it fits. The engine and the HTTP front end both ask this, before anything is queued.

    Only what can never run is refused. A group whose samples would together outgrow the KV pool
    is admitted, as SGLang admits it: `max_new_tokens` is a cap few samples reach, and when the pool
    runs dry the newest samples are preempted and recomputed once others finish. What must fit is
    one sample alone (its prompt and every token it may add), and the prompt's prefill with the
    first token of each of its `n` samples, which are placed together."""
    if params.n > max_running_seqs:
        return "n", (f"{params.n} samples exceed the {max_running_seqs} sequences the engine runs at once "
                     "(--max-running-seqs); send at most that many per request")
    if prompt_len >= max_model_len:
        return "prompt", f"the prompt has {prompt_len} tokens; the context holds {max_model_len}"
    if prompt_len + params.max_new_tokens > max_model_len:
        return "max_new_tokens", (f"{params.max_new_tokens} new tokens + the prompt's {prompt_len} exceed the context "
                                  f"length {max_model_len}; ask for at most {max_model_len - prompt_len} new tokens")
    if prompt_len + params.max_new_tokens > kv_tokens:
        return "max_new_tokens", (f"one sample needs up to prompt + max_new_tokens = {prompt_len + params.max_new_tokens} "
                                  f"KV slots, more than the pool holds ({kv_tokens}); ask for at most "
                                  f"{kv_tokens - prompt_len} new tokens, or raise --kv-cache-tokens")
    if prompt_len + params.n > kv_tokens:
        return "n", (f"the prompt's {prompt_len} KV slots and one for each of {params.n} samples' first tokens "
                     f"exceed the pool ({kv_tokens}); lower n, or raise --kv-cache-tokens")
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_key(k) -> int:
    """A logit_bias key: a token id, or its decimal string (JSON object keys are strings)."""
    if _is_int(k):
        return k
    if isinstance(k, str) and k.strip().isdigit():
        return int(k)
    raise ValueError(f"sampling_params.logit_bias keys must be token ids (got {k!r})")


def option(default, help: str, choices: tuple[str, ...] | None = None):
    """A config field that is also a command-line flag (`add_args`): written once, here. `choices`
    bind both the flag and the field (`_check_choices`)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _check_choices(config, what: str = "") -> None:
    for f in fields(config):
        choices = f.metadata.get("choices")
        if choices and getattr(config, f.name) not in choices:
            raise ValueError(f"{what}{f.name} {getattr(config, f.name)!r}: choose {', '.join(choices)}")


@dataclass
class SpecConfig:
    """Speculation knobs; defaults suit a single GPU and the CPU alike. Flags: `--spec-<name>`."""

    method: str = option("auto", "auto = the n-gram index, and a draft head where the index has nothing (hybrid): "
                         "--spec-draft-model's, or the default model's own; eagle: the head alone; mtp: the model's "
                         "own MTP layer; ngram: the index alone",
                         ("off", "ngram", "eagle", "mtp", "auto"))
    draft_model: str | None = option(None, "a draft head's HF directory (--spec eagle or auto), or `default`: the "
                                     "default model's EAGLE-3 head, kept in the repository")
    head_min_accept: float = option(0.2, "a draft head whose first drafts are accepted less often than this under a "
                                    "weight version is switched off for it (probed now and then; on when its weights are pushed)")
    max_draft_tokens: int = option(8, "the widest tree (draft nodes per sequence per step) and the deepest draft, at most 63")
    head_steps: int = option(3, "a draft head's tree depth (SGLang's --speculative-num-steps), at most max_draft_tokens: "
                             "each level is a step of the head for every sequence, worth it only while its drafts are accepted")
    head_topk: int = option(1, "a draft head's likeliest tokens at each level of its tree (EAGLE-2's dynamic tree, SGLang's "
                            "--speculative-eagle-topk); the tree keeps the max_draft_tokens likeliest; 1: a chain")
    max_verify_tokens: int = option(2048, "rows a step computes over the whole batch (a root per sequence and its drafts); speculation narrows as the batch grows")
    min_match: int = option(1, "the shortest suffix of a sequence that drafts")
    max_match: int = option(6, "the longest suffix matched (the search window)")
    history_rows: int = option(1024, "finished samples kept on the device for later rollouts of their prompt")
    history_per_prompt: int = option(16, "of those, at most this many per prompt (the newest)")
    share_siblings: bool = option(True, "share drafts between sibling samples and with earlier rollouts of the prompt")
    adaptive: bool = option(True, "adapt the drafts verified per step to measured costs and acceptance, rather than verify as many as fit")

    def __post_init__(self) -> None:
        _check_choices(self, "spec ")
        if not 0 <= self.max_draft_tokens <= 63:
            raise ValueError("spec max_draft_tokens must be in [0, 63] (trees hold at most 64 tokens)")
        if not 1 <= self.min_match <= self.max_match <= 32:
            raise ValueError("spec matching needs 1 <= min_match <= max_match <= 32")
        if self.history_rows < 0 or self.history_per_prompt < 0 or self.max_verify_tokens < 1:
            raise ValueError("spec history_rows and history_per_prompt must be >= 0, max_verify_tokens >= 1")
        if self.head_steps < 1 or self.head_topk < 1:
            raise ValueError("spec head_steps and head_topk must be >= 1")
        if self.head_rows > 64:
            raise ValueError("spec head_topk x (head_steps - 1) must be at most 64: the head's rows above a tree's "
                             "last level share a tree mask (trees hold at most 64 tokens)")
        if self.method == "eagle" and self.draft_model is None:
            raise ValueError("spec eagle needs a draft model (--spec-draft-model PATH)")
        if self.method in ("off", "ngram", "mtp") and self.draft_model is not None:
            raise ValueError(f"a draft model needs --spec eagle or auto, not {self.method}")

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.max_draft_tokens > 0

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters that run: ngram, a head (eagle, or the model's mtp layer), or the index and
        a head from --spec-draft-model (hybrid: `auto` with a head)."""
        if not self.enabled:
            return ()
        if self.method in ("eagle", "mtp"):
            return (self.method,)
        return ("ngram", "eagle") if self.draft_model is not None else ("ngram",)

    @property
    def head_depth(self) -> int:
        """A draft head's tree depth."""
        return min(self.head_steps, self.max_draft_tokens)

    @property
    def head_rows(self) -> int:
        """The rows a head's tree steps run over, past a sequence's end: every level's but the last's."""
        return self.head_topk * (self.head_depth - 1)

    @property
    def head_nodes(self) -> int:
        """Drafts in a head's tree: the likeliest of its depth x topk, within max_draft_tokens."""
        return min(self.head_topk * self.head_depth, self.max_draft_tokens)

    @property
    def tree_width(self) -> int:
        """Draft nodes per sequence per step: a head's tree when the head drafts alone, else the
        n-gram trees' (a hybrid's head trees are padded to them)."""
        return self.head_nodes if "ngram" not in self.drafters else self.max_draft_tokens


def core_share(processes: int) -> int:
    """Torch threads for each of `processes` engine processes that share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // processes)


@dataclass
class EngineConfig:
    """The engine's settings. Flags: `--<name>` (`--no-<name>` for a setting that is on by default)."""

    model: str = option("default", "'default' (SmolLM2-135M-Instruct) or a local HF directory")
    load_format: str = option("auto", "dummy = random weights (speed work on shapes without a checkpoint)", ("auto", "dummy"))
    device: str = option("auto", "auto, cpu, cuda or cuda:N (auto = cuda when there is one)")
    dtype: str = option("auto", "auto = float32 on CPU, bfloat16 on CUDA", ("auto", "float32", "bfloat16", "float16"))
    attention_backend: str = option("auto", "auto = triton on CUDA, torch elsewhere", ("auto", "torch", "triton"))
    max_model_len: int | None = option(None, "default: the model's context, capped at 8192")
    max_running_seqs: int = option(256, "sequences decoded together, at most")
    max_prefill_tokens: int | None = option(None, "tokens per step across prefill chunks (default: 4096 on CUDA, 512 on "
                                            "the CPU, where a step of 4,096 prompt tokens of the default model takes 20 s)")
    schedule_conservativeness: float = option(1.0, "how much of the KV pool admission keeps for what running samples are "
                                              "expected to add (SGLang's flag: it scales that estimate; 0: admit whatever "
                                              "fits now, and preempt when the pool runs dry)")
    kv_cache_tokens: int | None = option(None, "KV pool size in tokens (default: from the memory fraction on CUDA, 16,384 on CPU)")
    kv_cache_memory_fraction: float = option(0.85, "share of free GPU memory the KV pool takes when its size is not given")
    cuda_graphs: bool = option(True, "decode steps, and a lone request's prefill chunks (<= 512 tokens), as CUDA graphs")
    overlap_schedule: bool = option(True, "launch each decode step before the host has the previous step's tokens")
    pdl: bool = option(True, "use programmatic dependent launch for the Triton kernels on Hopper (process-wide)")
    tp_size: int = option(1, "GPUs (CPU processes) one engine runs over, the model split across them (tensor "
                          "parallelism; NCCL on CUDA, gloo on the CPU)")
    disable_custom_all_reduce: bool = option(False, "tensor parallelism on CUDA: every all-reduce and gather NCCL's (by "
                                             "default a decode step's go over symmetric memory, P2P: faster at these sizes)")
    dp_size: int = option(1, "engine replicas behind this server, each a process on its own device (data parallelism; "
                          "a prompt's requests stay on one replica)")
    cpu_threads: int = option(0, "torch threads of each engine process on the CPU (0: the cores split evenly among "
                              "the server's replicas and ranks: more threads than cores stall them all)")
    base_gpu_id: int = option(0, "the first GPU this server takes (device auto or cuda): replica i's rank r runs on "
                              "cuda:(base_gpu_id + i * tp_size + r)")
    seed: int = option(0, "seeds the samples of requests that give no seed")
    coupled_sampling: bool = option(False, "a request that gives no seed gets one from its prompt's token ids and --seed, "
                                    "so every rollout of a prompt draws sample i with the same noise, and a later "
                                    "rollout drafts from the earlier one (drafter source `coupled`); implies "
                                    "--enable-deterministic-inference, so a token is computed alike in any step")
    enable_deterministic_inference: bool = option(False, "batch-invariant kernels (SGLang's flag): a request with a seed "
                                                  "gets bitwise the same tokens and logprobs alone or in any batch, before "
                                                  "or after a preemption, with speculation on or off (its drafts are "
                                                  "chains: a tree's nodes would sum their keys in another order)")
    enable_fp32_residual: bool = option(False, "half precision: keep the residual stream between sublayers in float32 "
                                        "(no weight bytes; with --enable-fp32-lm-head bfloat16's logprob mismatch "
                                        "against a float32 trainer 0.73x on an H200: docs/numerics.md)")
    enable_fp32_lm_head: bool = option(False, "half precision: the LM head's input in float32, through a product over "
                                       "the served weight (SGLang's flag; no weight bytes)")
    enable_fp32_activations: bool = option(False, "half precision: float32 between the products (each attention and "
                                           "dense MLP product writes its float32 accumulator; rope, SiLU x up and the "
                                           "norms work on it and round once where a product or the KV cache reads); "
                                           "implies the two islands above (no weight bytes; docs/numerics.md)")
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if isinstance(self.spec, str):
            self.spec = SpecConfig(method=self.spec)
        if self.model == "default" and self.spec.method == "auto" and self.spec.draft_model is None and self.tp_size == 1:
            self.spec = replace(self.spec, draft_model="default")  # its head is in the repository: the hybrid out of the box
        if self.spec.draft_model == "default":  # (resolved here, while the model is still named: the server swaps in its path)
            if self.model != "default":
                raise ValueError(f"--spec-draft-model default is the default model's head (SmolLM2-135M-Instruct), not "
                                 f"{self.model!r}'s: give a head's directory (recipes/train_eagle.py trains one)")
            self.spec = replace(self.spec, draft_model=str(DEFAULT_HEAD))
        _check_choices(self)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r}: choose auto, cpu, cuda or cuda:N")
        if self.dp_size < 1 or self.tp_size < 1 or self.base_gpu_id < 0 or self.cpu_threads < 0:
            raise ValueError("dp_size and tp_size must be >= 1, base_gpu_id and cpu_threads >= 0")
        if self.device.startswith("cuda:") and (self.dp_size > 1 or self.tp_size > 1 or self.base_gpu_id):
            raise ValueError(f"device {self.device!r} names one GPU: with dp_size, tp_size or base_gpu_id give --device cuda "
                             "(or auto)")
        if self.max_running_seqs < 1 or (self.max_prefill_tokens is not None and self.max_prefill_tokens < 1):
            raise ValueError("max_running_seqs and max_prefill_tokens must be >= 1")
        if not 0 <= self.schedule_conservativeness <= 10:
            raise ValueError("schedule_conservativeness must be in [0, 10]")
        if self.batch_invariant and self.spec.head_topk > 1 and {"eagle", "mtp"} & set(self.spec.drafters):
            # a tree's node sits beside its siblings, not at its position, and attention would sum
            # its keys in another order than decoding that token does (kernels/triton_attention.py)
            raise ValueError("deterministic inference (and coupled sampling) verifies chains: --spec-head-topk must be 1")

    @property
    def batch_invariant(self) -> bool:
        """A token's row is computed to the same bits in any step (--enable-deterministic-inference,
        which coupled sampling implies): batch-invariant kernels, and drafts that are chains."""
        return self.enable_deterministic_inference or self.coupled_sampling

    def replica(self, dp_rank: int) -> "EngineConfig":
        """The settings of replica `dp_rank`: one replica, on the GPU `dp_rank` past this server's first
        (the engine process resolves the device: the front end never touches CUDA), and on the CPU
        its share of the cores (two replicas of two threads each on two cores took 4x as long)."""
        threads = self.cpu_threads or (core_share(self.dp_size * self.tp_size) if self.dp_size > 1 else 0)
        return replace(self, dp_size=1, base_gpu_id=self.base_gpu_id + dp_rank * self.tp_size, cpu_threads=threads)

    @staticmethod
    def from_dict(raw: dict) -> "EngineConfig":
        """From `dataclasses.asdict` of one (JSON between processes)."""
        return EngineConfig(**{**raw, "spec": SpecConfig(**raw.get("spec", {}))})

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """The engine's flags, for every subcommand that builds one."""
        _add_args(parser.add_argument_group("engine"), EngineConfig, "")
        _add_args(parser.add_argument_group("speculation"), SpecConfig, "spec")

    @staticmethod
    def from_args(args: argparse.Namespace) -> "EngineConfig":
        return EngineConfig(**_values(args, EngineConfig, ""), spec=SpecConfig(**_values(args, SpecConfig, "spec")))


def _flag_fields(cls, prefix: str):
    """(field, dest, type) for each of cls's flags; `method` is the prefix's own flag (`--spec`)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if "help" in f.metadata:
            dest = prefix if f.name == "method" else "_".join(filter(None, (prefix, f.name)))
            kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
            yield f, dest, kind


def _add_args(group, cls, prefix: str) -> None:
    for f, dest, kind in _flag_fields(cls, prefix):
        flag = "--" + dest.replace("_", "-")
        if kind is bool and f.default:
            no = "--" + "-".join(filter(None, (prefix, "no", f.name.replace("_", "-"))))
            group.add_argument(no, dest=dest, action="store_false", help=f"do not {f.metadata['help']}")
        elif kind is bool:
            group.add_argument(flag, dest=dest, action="store_true", help=f.metadata["help"])
        else:
            group.add_argument(flag, dest=dest, type=kind, default=f.default, choices=f.metadata["choices"],
                               help=f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})"))


def _values(args: argparse.Namespace, cls, prefix: str) -> dict:
    return {f.name: getattr(args, dest) for f, dest, _ in _flag_fields(cls, prefix)}
