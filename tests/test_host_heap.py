"""An engine's host memory: a CPU engine's steps reuse freed host memory instead of mapping it afresh
(rollout/engine/build.py: keep_host_heap), and a finished rollout is freed by reference counting, not left
to Python's cyclic collector (Request.detach)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rollout import Engine, SamplingParams
from rollout.engine.sequence import Request, Sequence

PROBE = textwrap.dedent("""
    import resource, sys, torch
    from rollout import Engine

    def faults_per_block():  # 48 MiB blocks, above the largest glibc keeps by default (32 MiB), once it settles
        for _ in range(20):
            torch.ones(12 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            torch.ones(12 << 20)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10

    alone = faults_per_block()
    Engine(model=sys.argv[1], spec="off", device="cpu")
    print(alone, faults_per_block())
""")


def test_a_cpu_engines_process_reuses_freed_blocks_instead_of_faulting_them_in_again(model_dir):
    """A CPU step's large temporaries were mapped, faulted in page by page and unmapped at every step:
    17.8 million minor faults in one rollout of the demo's prompts on a spec-off server, at 55.6
    tokens/s against 88.9 after. In a fresh process (glibc's malloc is process-wide), a 48 MiB block
    allocated and freed over and over is faulted in 4 KiB pages every time until an engine is built,
    and reused after."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout.split()
    before, after = int(out[-2]), int(out[-1])
    assert before > 10_000  # ~12,288 pages: mapped afresh
    assert after < 100


def keep_what_the_collector_finds() -> None:
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what a collection finds unreachable stays in gc.garbage)


def cyclic_requests_found() -> list[str]:
    """The requests and sequences a full collection finds unreachable since `keep_what_the_collector_finds`;
    the collector back as it was."""
    try:
        gc.collect()
        return [type(o).__name__ for o in gc.garbage if isinstance(o, (Request, Sequence))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def cyclic_requests_after(run) -> list[str]:
    """The requests and sequences a full collection finds unreachable after `run()` (and nothing else)."""
    keep_what_the_collector_finds()
    try:
        run()
    finally:
        found = cyclic_requests_found()  # (the collector back as it was, also when run() raised)
    return found


def follower_probe(engine: Engine) -> dict:
    """A tensor-parallel rank's handlers (Engine's `tp_hooks`): `probe_start`, and `probe_end(path)`, which
    writes there what a full collection found of requests and sequences in between."""

    def end(path: str) -> None:
        Path(path + ".part").write_text(json.dumps(cyclic_requests_found()))
        os.replace(path + ".part", path)

    return {"probe_start": keep_what_the_collector_finds, "probe_end": end}


def test_a_finished_rollout_leaves_no_request_or_sequence_for_the_cyclic_collector(model_dir):
    """A request and its samples point at each other. Left as a cycle, every rollout's samples waited for
    a full collection, which freed many rounds' token lists at once inside one step (158 ms in a grpo b512
    rollout of 0.65 s on an H200). Once `generate` hands the outputs out, nothing of them is cyclic garbage."""
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu")
    prompts = [[5 + k, 9, 13, 7, 11 + k] * 3 for k in range(3)]

    def rollouts():
        for seed in (3, 4):  # (the second rollout's steps replace what the engine's last step still holds)
            outputs = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=seed))
            assert [len(o) for o in outputs] == [4, 4, 4] and all(s.token_ids for o in outputs for s in o)

    assert cyclic_requests_after(rollouts) == []


def test_the_servers_loop_lets_go_of_a_request_once_its_last_output_is_sent(model_dir):
    """The same in the server's engine process, streaming or not."""
    from rollout.server import protocol
    from rollout.server.engine_loop import EngineLoop

    class Pipe:
        def __init__(self):
            self.finished = set()

        def send(self, data):
            msg = protocol.unpack(data)
            if isinstance(msg, protocol.Outputs):
                self.finished |= {r.rid for r in msg.requests if all(s.finish for s in r.samples)}

    engine = Engine(model=str(model_dir), device="cpu", spec="ngram")
    loop = EngineLoop(engine, recv=None, send=(pipe := Pipe()))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)

    def requests():
        for round_ in range(2):
            loop.take_batch([protocol.AddRequest(f"{round_}-{stream}", [5, 6, 7, 8], params, True, 0, stream)
                             for stream in (False, True)], [])
            while engine.has_work:
                loop._step()
        assert pipe.finished == {"0-False", "0-True", "1-False", "1-True"}

    assert cyclic_requests_after(requests) == []


def test_a_tensor_parallel_follower_lets_go_of_a_finished_rollout_as_rank_0_does(model_dir, tmp_path, monkeypatch):
    """A rank > 0 replays rank 0's requests and hands nothing out: it lets go of a request's sequences
    itself once the request finished (StepLoop.collect)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu", tp_size=2, tp_hooks="test_host_heap:follower_probe")
    found = tmp_path / "found.json"
    try:
        engine.tp.record("probe_start")
        engine.tp.flush()
        for seed in (3, 4):
            engine.generate([[5, 9, 13, 7, 11] * 3, [6, 9, 13, 7, 12] * 3],
                            SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=seed))
        engine.tp.record("probe_end", str(found))
        engine.tp.flush()
        deadline = time.monotonic() + 60
        while not found.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found.exists(), "rank 1 did not report within 60 s"
        assert json.loads(found.read_text()) == []
    finally:
        engine.close()
