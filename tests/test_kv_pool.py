import numpy as np
import pytest
import torch

from rollout.engine.kv_pool import KVPool, OutOfSlots


def pool(num_slots=16) -> KVPool:
    return KVPool(1, num_slots, 1, 4, torch.float32, torch.device("cpu"), max_rows=4, max_context=8)


def test_shared_slots_return_to_the_free_list_with_the_last_reference():
    p = pool()
    prompt = p.alloc(5)
    p.share(prompt)
    p.share(prompt)
    assert p.used_slots == 5
    p.release(prompt)
    p.release(prompt)
    assert p.used_slots == 5
    p.release(prompt)
    assert p.used_slots == 0 and p.free_slots == 15


def test_slot_zero_is_never_handed_out_and_exhaustion_raises():
    p = pool()
    slots = p.alloc(15)
    assert 0 not in slots and len(set(slots.tolist())) == 15
    with pytest.raises(OutOfSlots):
        p.alloc(1)
    p.release(slots[:3])
    assert sorted(p.alloc(3).tolist()) == sorted(slots[:3].tolist())


def test_rows_are_recycled():
    p = pool()
    rows = [p.alloc_row() for _ in range(4)]
    assert sorted(rows) == [0, 1, 2, 3] and p.free_rows == 0
    p.free_row(rows[1])
    assert p.alloc_row() == rows[1]
    assert isinstance(p.rows_host, np.ndarray)
