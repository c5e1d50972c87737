"""Compile, for an H100/H200 (sm_90), every Triton kernel launch that CPU tests make in Triton's interpreter, on a
machine without a GPU. A kernel the interpreter runs can still fail to compile (a variable redefined at another shape
inside an `if`), which only a GPU call showed until now (moe-down-combine's first run,
bench/results/session-20261201e/route-why.log).

The tests run in the interpreter as usual; each launch's specialization (argument types, alignments, constexprs,
options) is recorded, and a second process, where nothing runs interpreted (the interpreter patches triton.language
while it runs a kernel), compiles each to PTX and cubin. A kernel that an autotuner of its module wraps (which the
interpreter's callers launch at one fixed tile) is also compiled at each of the autotuner's configurations that its
pruning leaves, on the launch's arguments after the configuration's pre_hook. A kernel with inline assembly (the
sampler's) fails in the interpreter after its launch is recorded: its tests fail, its compile is still checked.

    pip install --target /tmp/triton36 --no-deps triton==3.6.0   # (numpy < 2.3 beside it: the interpreter's)
    PYTHONPATH=/tmp/np21:/tmp/triton36:. python bench/probes/compile_for_gpu.py tests/test_fused_kernels.py \
        tests/test_fused_moe_kernel.py tests/test_triton_attention.py tests/test_ngram_draft_kernel.py \
        tests/test_draft_rows_kernel.py tests/test_tree_accept.py tests/test_sampled_tree_accept.py

On the CPU (2026-12-01): 21 kernels, 416 specializations (the autotuners' configurations included), all compiled;
with tests/test_sampling_kernel.py, the sampler's two kernels too.

Arguments are pytest's. It ends with each kernel's compiled specializations and fails if any did not compile.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from collections import Counter

TARGET = ("cuda", 90, 32)


def record_launches(path: str, pytest_args: list[str]) -> int:
    """Run the tests in the interpreter; write every new launch specialization to `path`."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit as triton_jit
    from triton.runtime.interpreter import InterpretedFunction

    from triton.runtime.autotuner import Autotuner
    from triton.tools.tensor_descriptor import TensorDescriptor

    backend = make_backend(GPUTarget(*TARGET))
    binders: dict = {}
    launches: dict[tuple, tuple] = {}
    run = InterpretedFunction.run

    def record(fn, args, kwargs) -> None:
        if fn not in binders:
            twin = triton_jit.JITFunction(fn)  # (only for its binding of arguments to a specialization)
            binders[fn] = (twin, triton_jit.create_function_from_signature(twin.signature, twin.params, backend))
        twin, binder = binders[fn]
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = twin._pack_args(backend, dict(kwargs), bound, specialization, options)
        spec = (fn.__module__, fn.__qualname__, signature, constexprs, attrs, options.__dict__)
        launches.setdefault(repr(spec), spec)

    def autotuners_of(fn) -> list:
        module = sys.modules[fn.__module__]
        return [tuner for tuner in vars(module).values()
                if isinstance(tuner, Autotuner) and getattr(tuner.fn, "fn", None) is fn]

    def tuned_launches(tuner, args: tuple, kwargs: dict):
        """The launches the autotuner could make of these arguments: its configurations left by its pruning, each
        after its pre_hook (which may set a tensor descriptor's block to the tile), on copies of the descriptors."""
        named = dict(zip(tuner.arg_names, args))
        configs = tuner.configs
        if tuner.early_config_prune:
            configs = tuner.early_config_prune(configs, named, **kwargs)
        for config in configs:
            nargs = {**{k: copy.copy(v) if isinstance(v, TensorDescriptor) else v for k, v in named.items()}, **kwargs,
                     **config.all_kwargs()}
            if config.pre_hook:
                config.pre_hook(nargs)
            yield tuple(nargs[name] for name in list(named)), {**kwargs, **config.all_kwargs()}

    def recording_run(self, *args, grid, warmup, **kwargs):
        record(self.fn, args, kwargs)
        for tuner in autotuners_of(self.fn):
            for tuned_args, tuned_kwargs in tuned_launches(tuner, args, kwargs):
                record(self.fn, tuned_args, tuned_kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    status = pytest.main(["-q", "-o", "addopts=", "-p", "no:cacheprovider", *pytest_args])
    with open(path, "wb") as f:
        pickle.dump(list(launches.values()), f)
    return int(status)


def compile_launches(path: str) -> int:
    """Compile each recorded specialization for TARGET (nothing interpreted in this process)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    target = GPUTarget(*TARGET)
    compiled: Counter[str] = Counter()
    failed: dict[str, str] = {}
    with open(path, "rb") as f:
        launches = pickle.load(f)
    for module, name, signature, constexprs, attrs, options in launches:
        label = f"{module}.{name}"
        try:
            kernel = getattr(importlib.import_module(module), name)
            compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
            compiled[label] += 1
        except Exception as e:  # noqa: BLE001 (each failure is the report)
            failed.setdefault(label, f"{type(e).__name__}: {e}")
    print(f"\n| kernel | specializations compiled for sm_{TARGET[1]} |\n|---|---|")
    for label, n in sorted(compiled.items()):
        print(f"| {label} | {n} |")
    for label, error in failed.items():
        print(f"\nFAILED to compile {label}:\n{error}")
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:2] == ["--compile"]:
        return compile_launches(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.pickle")
        status = record_launches(path, sys.argv[1:])
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        compiled = subprocess.run([sys.executable, __file__, "--compile", path], env=env).returncode
    return status or compiled


if __name__ == "__main__":
    sys.exit(main())
