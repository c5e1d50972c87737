"""Which token rows each sequence's drafts come from: its prompt's group, and the group's history.

Sequences with the same prompt form a group (the `n` samples of a request, and any other
request for that prompt): each searches the rows of all of them, its own included, and the
group's history, the rows of samples that finished (RL rolls a prompt out again every epoch,
so the last epoch's samples draft for this one; none of it depends on the weights, so it
stays valid across weight updates). A group's rows are one line of a device table, which the
drafter reads by group id; it changes only when a member joins or leaves, and the lines of
the groups that changed are written and go to the device together, once per step (`flush`:
the n samples of a prompt join in one step, and many finish in one step of a large batch).

History is bounded: a fixed number of rows of the token table (`SpecConfig.history_rows`), at
most `history_per_prompt` per prompt, the group's oldest sample going first; when no row is
free, the least recently used prompt's oldest sample goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from spec.step import Drafted, to_device
from spec.token_table import TokenTable


@dataclass(eq=False)
class _Group:
    live: list[int] = field(default_factory=list)  # rows of running members
    history: deque = field(default_factory=deque)  # rows of finished members, oldest first
    gid: int = -1  # line in the scan table while the group has live members


class NgramIndex:
    def __init__(self, table: TokenTable, scan_width: int, history_per_prompt: int, share: bool = True):
        self.table = table
        self.scan_width = scan_width
        self.history_per_prompt = history_per_prompt
        self.share = share  # off: each sample searches only its own row
        self.scan = torch.full((table.padding_row + 1, scan_width), -1, dtype=torch.int32, device=table.device)
        self.reset()

    def reset(self) -> None:
        """Forget every group, running or finished, in place: the scan table stays the tensor that
        captured CUDA graphs read. (The token table's rows are its owner's to reset.)"""
        self.scan.fill_(-1)
        self._changed: dict[int, _Group] = {}  # groups whose lines are not on the device yet, by identity
        self._groups: OrderedDict[Hashable, _Group] = OrderedDict()  # least recently used first
        self._free_gids = list(range(self.table.padding_row, -1, -1))
        self._free_history = list(range(self.table.num_rows - 1, self.table.history_start - 1, -1))
        self._key: dict[int, Hashable] = {}  # seq_id -> its group's key while it is live

    # ---- membership ----
    def join(self, seq: Drafted) -> None:
        """`seq` runs (its prefill is done): its row joins its prompt's group."""
        key = tuple(seq.request.prompt_ids) if self.share else ("own", seq.seq_id)
        group = self._groups.pop(key, None) or _Group()
        self._groups[key] = group  # most recently used
        if group.gid < 0:
            group.gid = self._free_gids.pop()
        group.live.append(seq.row)
        self._key[seq.seq_id] = key
        seq.group = group.gid
        self._publish(group)

    def leave(self, seq: Drafted, keep: bool) -> None:
        """`seq` stops running (finished, aborted or preempted); `keep`: its tokens become history."""
        key = self._key.pop(seq.seq_id, None)
        if key is None:
            return
        group = self._groups[key]
        group.live.remove(seq.row)
        if keep and self.share and seq.num_output:
            row = self._history_row(group)
            if row is not None:
                self.table.keep(seq.row, row, len(seq.tokens), seq.num_prompt)
                group.history.append(row)
                seq.history_row = row
        if not group.live:
            self._free_gids.append(group.gid)
            group.gid = -1
            if not group.history:
                del self._groups[key]
        else:
            self._publish(group)
        seq.group = 0

    def clear_history(self) -> None:
        """Forget every finished sample (benchmarks: no drafting from an earlier run)."""
        for key, group in list(self._groups.items()):
            for row in group.history:
                self.table.forget(row)
                self._free_history.append(row)
            group.history.clear()
            if group.live:
                self._publish(group)
            else:
                del self._groups[key]

    # ---- numbers ----
    @property
    def history_rows_used(self) -> int:
        return self.table.num_rows - self.table.history_start - len(self._free_history)

    def _history_row(self, group: _Group) -> int | None:
        """A row for one more sample of `group`: its oldest at its limit, a free one, or the least
        recently used prompt's oldest (None: no history rows at all)."""
        if len(group.history) >= self.history_per_prompt:
            return group.history.popleft()
        if self._free_history:
            return self._free_history.pop()
        key, victim = next(((k, g) for k, g in self._groups.items() if g.history and g is not group), (None, group))
        if not victim.history:
            return None
        row = victim.history.popleft()
        if victim.gid >= 0:
            self._publish(victim)
        elif not victim.history:
            del self._groups[key]
        return row

    def _publish(self, group: _Group) -> None:
        """The group's line changed: written at the next `flush`."""
        self._changed[id(group)] = group

    def flush(self) -> None:
        """The changed groups' lines of the scan table (live rows, then history, newest first) to
        the device, in one copy. A group that has no line any more (no live member) has none to write."""
        if self._changed:
            groups = [g for g in self._changed.values() if g.gid >= 0]
            self._changed.clear()
            if not groups:
                return
            packed = np.full((len(groups), 1 + self.scan_width), -1, dtype=np.int32)  # line id, then its rows
            for line, g in zip(packed, groups):
                rows = (g.live + list(reversed(g.history)))[: self.scan_width]
                line[0] = g.gid
                line[1 : 1 + len(rows)] = rows
            packed = to_device(packed, self.scan.device)
            self.scan[packed[:, 0]] = packed[:, 1:]
