"""The tensor-parallel ranks' small collectives (a decode step's) over symmetric memory.

All-reduce: torch's one-shot kernel copies each rank's part into a buffer its peers can read over
NVLink (CUDA P2P; never NVLink multicast) and sums every rank's buffer in rank order: every rank gets
the same bits, as the ranks must (they sample from these logits), and a row's sum does not depend on
how many rows the step has. NCCL's ring costs more at these sizes: through the engine's group in a
CUDA graph on 2 H200s, [1, 4096] bf16 took 16.1 us against 6.6, [64, 4096] 21.4 against 11.1
(bench/allreduce_latency.py; over 4 H200s 20.0 against 8.4). Larger ones (prefill) stay NCCL's.

All-gather (the LM head's logits, each rank's slice of the vocabulary): the same sum, over parts
that each rank places in its own columns of a zeroed buffer. Adding zeros is exact, so this is the
gather, bit for bit: [1, 64128] float32 a rank over 2 H200s took 13.1 us against NCCL's 21.2.

All-reduce then RMSNorm (the decoder's o and down products, then the next norm), for few rows: one
Triton kernel over a buffer of its own (kernels/all_reduce_norm.py). The same kernel without the norm
sums float16, which torch's kernel does not take, up to as many rows as the flags allow (a decode
step's 64 at TP4).
"""

from __future__ import annotations

import logging
import os

import torch

from kernels import all_reduce_norm

log = logging.getLogger("rollout")

MAX_BYTES = 64 * 5120 * 2  # the largest all-reduce measured: [64, 5120] bf16 over 4 H200s, 16.0 us against NCCL's 31.3
MAX_NORM_ROWS = 16  # the most rows the fused all-reduce + RMSNorm takes, a program each (kernels/all_reduce_norm.py)
SLOT_BYTES = MAX_BYTES  # a rank's slot in that kernel's buffer (16 rows of a hidden size 8192 in bf16 take 256 KiB)
COUNT_KEY = "rollout-symm-rendezvous"  # rank 0's count of rendezvous, in the ranks' store

_rendezvous_made = 0  # symmetric-memory rendezvous this process has made (`catch_up`)


def _rendezvous(buffer: torch.Tensor, group_name: str):
    global _rendezvous_made
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, group_name)
    _rendezvous_made += 1
    return handle


def _register(group) -> None:
    from torch._C._distributed_c10d import _register_process_group

    _register_process_group(group.group_name, group)


def catch_up(count: int, device: torch.device) -> None:
    """Make this process's rendezvous `count`. Torch names the store keys of a rendezvous by how many
    this process has made, so ranks that meet must have made equally many: rank 0 of an engine
    built in a process that built one before (bench, one per mode; the tests) has made more than its
    new ranks, which then waited for ever. They make up the difference with rendezvous of their own,
    each a group of one."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import HashStore, ProcessGroup, ProcessGroupGloo

    while _rendezvous_made < count:
        store = HashStore()
        group = ProcessGroup(store, 0, 1)
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, ProcessGroupGloo(store, 0, 1, opts))
        group._set_default_backend(ProcessGroup.BackendType.GLOO)  # (a group's name lives on its backend)
        group._set_group_name(f"rollout-catch-up-{os.getpid()}-{_rendezvous_made}")
        _register(group)
        _rendezvous(symm_mem.empty(16, dtype=torch.uint8, device=device), group.group_name)


class OneShotAllReduce:
    def __init__(self, nccl, store, rank: int, size: int, device: torch.device):
        """`nccl`: the ranks' NCCL backend, wrapped here in a process group that torch's symmetric
        memory finds by name (it exchanges the buffers' handles through the group's store). A failure
        here is an error: `--disable-custom-all-reduce` runs NCCL alone."""
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import ProcessGroup

        self.name = f"rollout-tp-{store.port}"  # (the same on every rank: rank 0's store)
        self.rank, self.size = rank, size
        group = ProcessGroup(store, rank, size)
        group._register_backend(device, ProcessGroup.BackendType.NCCL, nccl)
        group._set_default_backend(ProcessGroup.BackendType.NCCL)
        group._set_group_name(self.name)
        _register(group)
        self._group = group
        self._buffer = symm_mem.empty(2 * MAX_BYTES, dtype=torch.uint8, device=device)  # (fp16 gathers staged as fp32)
        if rank == 0:
            store.set(COUNT_KEY, str(_rendezvous_made))
        else:
            catch_up(int(store.get(COUNT_KEY)), device)
        _rendezvous(self._buffer, self.name)
        # the Triton kernel's own buffer (kernels/all_reduce_norm.py): two halves of a slot per rank, its signal pad
        # (a flag per rank and row), and each row's calls
        self._triton_buffer = symm_mem.empty(2 * size * SLOT_BYTES, dtype=torch.uint8, device=device)
        handle = _rendezvous(self._triton_buffer, self.name)
        self._triton_buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self._triton_signals = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self._flag_rows = getattr(symm_mem, "get_signal_pad_size", lambda: 2048)() // 4 // size
        self._norm_rows = min(MAX_NORM_ROWS, self._flag_rows)
        self._epochs = torch.zeros(self._flag_rows, dtype=torch.int32, device=device)

    @staticmethod
    def reachable(device: torch.device) -> bool:
        """Whether this GPU reads every other one's memory (P2P). Where a rank's cannot, the ranks
        agree on NCCL for every collective, and the log says why (as SGLang's custom all-reduce does)."""
        me = device.index if device.index is not None else torch.cuda.current_device()
        ok = all(torch.cuda.can_device_access_peer(me, peer) for peer in range(torch.cuda.device_count()) if peer != me)
        if not ok:
            log.warning("tensor parallelism: cuda:%d has no P2P access to every other GPU; all-reduces and gathers are NCCL's", me)
        return ok

    def close(self) -> None:
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(self.name)

    def fits(self, x: torch.Tensor, parts: int = 1) -> bool:
        """Whether `x` (times `parts`: a gather's result) goes through the buffer."""
        small = x.numel() * x.element_size() * parts <= MAX_BYTES
        aligned = x.storage_offset() * x.element_size() % 16 == 0  # (the kernel's copy: as aligned as the buffer)
        return x.is_contiguous() and small and aligned and x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `all_reduce_norm(x, residual, ...)` takes the fused kernel (a program and a flag
        per rank for each row; x within a rank's slot of its buffer)."""
        return (all_reduce_norm.triton is not None and x.is_contiguous() and x.dim() == 2 and residual.is_contiguous()
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[0] <= self._norm_rows
                and x.numel() * x.element_size() <= SLOT_BYTES)

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None = None,
                        round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x summed over the ranks + residual), that sum), in one kernel."""
        return all_reduce_norm.all_reduce_rms_norm(x, residual, weight, eps, self._triton_buffers, SLOT_BYTES,
                                                   self._triton_signals, self._epochs, self.rank, out_dtype, round_once)

    def _staged(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._buffer[:nbytes].view(dtype).view(shape)  # (offset 0: the buffer's handle)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place (the kernel copies `x` into the buffer itself)."""
        if x.dtype == torch.float16:  # torch's kernel sums bf16 and fp32 only: the Triton kernel's sum, in place
            if x.dim() == 2 and x.shape[0] <= self._flag_rows and all_reduce_norm.triton is not None:
                return all_reduce_norm.all_reduce_sum(x, self._triton_buffers, SLOT_BYTES, self._triton_signals,
                                                      self._epochs, self.rank)
            return x.copy_(self.all_reduce(x.float()))  # (in float32, rounded once, as bf16 is)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self._staged(x.dtype, x.shape), x, "sum", self.name, x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[L, V] of each rank -> [L, size * V], rank order along the last dimension."""
        if x.dtype == torch.float16:  # (as all_reduce; fp16's values are exact in fp32)
            return self.all_gather(x.float()).to(torch.float16)
        rows, cols = x.shape
        staged = self._staged(x.dtype, (rows, self.size, cols))
        staged.zero_()
        staged[:, self.rank].copy_(x)
        out = torch.empty((rows, self.size * cols), dtype=x.dtype, device=x.device)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged.view(rows, self.size * cols), "sum", self.name, out)
        return out
