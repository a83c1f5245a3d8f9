"""The pooled transport's two halves in one process (strategies/_slots.py): what a worker packs into a
slot, the training process unpacks to equal tensors of every dtype and shape, viewing the slot, which
goes free once nothing refers to the batch."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from lightning_sharding.strategies._slots import SlotBatch, SlotPool, WorkerSlots

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,  # no NumPy twin: torch's own views
    torch.float32,
    torch.float64,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_packed_batch_unpacks_to_equal_tensors_viewing_its_slot(dtype: torch.dtype) -> None:
    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=False)
    try:
        slots = WorkerSlots(pool.states, 0)
        g = torch.Generator().manual_seed(0)
        values = (torch.rand(5, 3, generator=g) * 100 - 50).to(dtype)
        batch = {
            "v": values,
            "scalar": values[1, 1].clone(),
            "empty": torch.zeros(0, 4, dtype=dtype),
            "nested": [values[0].clone(), (torch.arange(7),)],
            "name": "kept",
        }
        packed = slots.pack(batch)
        assert isinstance(packed, SlotBatch)
        flag = pool.states.index(0, packed.slot)
        assert pool.states.flags[flag] == 1
        got = pool.unpack(packed)
        for key in ("v", "scalar", "empty"):
            assert got[key].dtype == dtype and got[key].shape == batch[key].shape and torch.equal(got[key], batch[key])
        assert torch.equal(got["nested"][0], values[0]) and torch.equal(got["nested"][1][0], torch.arange(7))
        assert got["name"] == "kept"
        view = got["v"]
        del got
        gc.collect()
        assert pool.states.flags[flag] == 1, "a tensor of the batch still views the slot"
        del view
        gc.collect()
        assert pool.states.flags[flag] == 0, "nothing views the slot any more: it is free"
    finally:
        pool.close()
