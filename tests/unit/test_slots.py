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


def _crops(n: int, seed: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.randint(0, 255, (3, 8, 8), generator=g, dtype=torch.uint8), "label": i} for i in range(n)]


def _expected(samples: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    return {"image": torch.stack([s["image"] for s in samples]), "label": torch.tensor([s["label"] for s in samples])}


def _free_all(pool: SlotPool) -> None:
    gc.collect()
    for i in range(len(pool.states.flags)):
        assert pool.states.flags[i] == 0, "a batch still holds its slot"


def test_a_batch_collated_straight_into_a_free_slot_is_sent_from_there_uncopied() -> None:
    """Once a slot is mapped, the next batch's tensors are stacked in it and sent where they lie; what
    the collate made elsewhere (the labels) is copied in after them. Every batch unpacks equal."""
    from lightning_sharding.strategies._batches import pooled_collate

    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=False)
    try:
        slots = WorkerSlots(pool.states, 0)
        samples = _crops(6, 0)
        slots.begin()  # no slot mapped yet: the first batch is made in the worker's memory and copied
        first = pooled_collate(samples, slots)
        assert slots.take((1,), torch.uint8) is None
        packed = slots.pack(first)
        assert isinstance(packed, SlotBatch)
        got = pool.unpack(packed)
        assert all(torch.equal(got[k], v) for k, v in _expected(samples).items())
        del got
        _free_all(pool)
        for seed in (1, 2):
            samples = _crops(6, seed)
            slots.begin()
            batch = pooled_collate(samples, slots)
            address = slots._addresses[packed.slot]
            assert batch["image"].data_ptr() == address, "the images are stacked in the free slot"
            packed = slots.pack(batch)
            assert isinstance(packed, SlotBatch) and pool.states.flags[pool.states.index(0, packed.slot)] == 1
            assert packed.tree["image"].offset == 0, "sent from where it was stacked"
            got = pool.unpack(packed)
            assert all(torch.equal(got[k], v) for k, v in _expected(samples).items())
            del got, batch
            _free_all(pool)
    finally:
        pool.close()


def test_a_batch_changed_after_its_collate_into_a_slot_still_arrives_as_changed() -> None:
    """A batch whose tensors are views of, or reordered from, what was stacked in the slot: copied in
    after the stacked ones, never over them; a tensor PyTorch's path sends (one that needs grad)
    keeps its slot to itself: the next batch is made elsewhere."""
    from lightning_sharding.strategies._batches import pooled_collate

    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=False)
    try:
        slots = WorkerSlots(pool.states, 0)
        slots.begin()
        pool.unpack(slots.pack(pooled_collate(_crops(6, 0), slots)))
        _free_all(pool)
        samples = _crops(6, 1)
        slots.begin()
        made = pooled_collate(samples, slots)
        changed = {"label": made["label"] * 2, "crop": made["image"][:, :, 2:6], "image": made["image"].flip(0)}
        want = {k: v.clone() for k, v in changed.items()}
        got = pool.unpack(slots.pack(changed))
        assert all(torch.equal(got[k], v) for k, v in want.items())
        del got
        _free_all(pool)

        slots.begin()
        made = pooled_collate(_crops(6, 2), slots)
        slot = slots._writing.slot  # type: ignore[union-attr]
        kept = {"image": made["image"], "grad": torch.zeros(2, requires_grad=True)}
        want_image = made["image"].clone()
        assert slots.pack(kept) is kept  # PyTorch's path: a tensor that needs grad
        assert slots.maps[slot] is None, "the slot stays with the tensors PyTorch's queue sends"
        slots.begin()
        again = pooled_collate(_crops(6, 3), slots)
        pool.unpack(slots.pack(again))
        assert torch.equal(kept["image"], want_image), "the next batch did not write over it"
    finally:
        pool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory)")
def test_with_pin_memory_batches_and_their_padding_flags_arrive_pinned() -> None:
    """On a GPU, each batch of a slot arrives pinned (copied out of the slot into PyTorch's pinned
    memory, which keeps it until a copy to the GPU that reads it is done), a batch kept while later
    ones come stays equal, every copy to the GPU is exact, and the padding flags are pinned too."""
    from lightning_sharding.strategies._delivery import flag_padding

    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=True)
    try:
        slots = WorkerSlots(pool.states, 0)
        kept = None
        for i, n in enumerate([1 << 20, 3 << 20, 3 << 20, 8 << 20, 1 << 20] * 2):
            g = torch.Generator().manual_seed(i)
            batch = {"x": torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8), "y": torch.arange(10)}
            got = flag_padding(pool.unpack(slots.pack(batch)), 10, 2, "is_padding", pin_memory=True)
            assert all(t.is_pinned() for t in got.values())
            on_gpu = {k: v.to("cuda", non_blocking=True) for k, v in got.items()}
            torch.cuda.synchronize()
            assert all(torch.equal(on_gpu[k].cpu(), batch[k]) for k in batch)
            assert on_gpu["is_padding"].tolist() == [False] * 8 + [True] * 2
            if i == 1:
                kept = (got, batch)
            del got, on_gpu
            gc.collect()
        assert kept is not None
        got, batch = kept
        assert torch.equal(got["x"].to("cuda").cpu(), batch["x"])
    finally:
        pool.close()


def test_batches_that_creep_larger_grow_their_slot_by_doubling_also_when_collated_into_it() -> None:
    """Padded to the longest sequence, batches grow a little each time: a batch that outgrows the slot
    it was stacked into goes to a new file twice the size, as a slot grows, not one file a batch."""
    from lightning_sharding.strategies._batches import pooled_collate

    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=False)
    try:
        slots = WorkerSlots(pool.states, 0)
        for i in range(40):
            samples = [{"tokens": torch.full((1000 + 50 * i,), j), "label": torch.tensor(j)} for j in range(8)]
            slots.reset()
            slots.begin()
            got = pool.unpack(slots.pack(pooled_collate(samples, slots)))
            assert torch.equal(got["tokens"], torch.stack([s["tokens"] for s in samples]))
            del got
            gc.collect()
        assert next(slots.generation) <= 4, "a new slot file for nearly every batch"
    finally:
        pool.close()


def test_a_batch_with_nothing_to_carry_goes_pytorchs_way() -> None:
    """Strings only, or empty tensors: nothing for a slot (mapping an empty file failed the worker)."""
    pool = SlotPool(1, 2, multiprocessing.get_context("spawn"), pin_memory=False)
    try:
        slots = WorkerSlots(pool.states, 0)
        for batch in ({"name": ["a", "b"]}, {"e": torch.zeros(0, 3)}):
            assert slots.pack(batch) is batch
    finally:
        pool.close()
