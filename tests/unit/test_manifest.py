"""Manifest validation, fingerprints and mismatch explanations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharding.core.manifest import Item, Manifest

SETTINGS = settings(max_examples=200, deadline=None)

keys = st.text(st.characters(codec="utf-8", exclude_characters="\t\n"), min_size=1, max_size=12)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    names = draw(st.lists(keys, min_size=1, max_size=8, unique=True))
    counts = draw(st.lists(st.integers(0, 1000), min_size=len(names), max_size=len(names)))
    if sum(counts) == 0:
        counts[0] = 1
    fps = draw(st.lists(st.text(max_size=6), min_size=len(names), max_size=len(names)))
    return Manifest.from_items(Item(k, c, f) for k, c, f in zip(names, counts, fps, strict=True))


def replace_item(m: Manifest, i: int, **changes: object) -> Manifest:
    items = list(m.items)
    items[i] = dataclasses.replace(items[i], **changes)
    return Manifest(tuple(items))


@SETTINGS
@given(manifests())
def test_counts_and_total(m: Manifest) -> None:
    assert m.counts.dtype == np.int64
    assert m.counts.tolist() == [it.num_samples for it in m.items]
    assert m.total == sum(it.num_samples for it in m.items)
    summary = m.summary()
    assert summary["num_items"] == len(m.items) and summary["total"] == m.total
    assert (summary["first_key"], summary["last_key"]) == (m.items[0].key, m.items[-1].key)
    with pytest.raises(ValueError):
        m.counts[0] = 5  # read-only


@SETTINGS
@given(manifests())
def test_fingerprint_is_stable(m: Manifest) -> None:
    again = Manifest.from_items(Item(it.key, it.num_samples, it.fingerprint) for it in m.items)
    assert again.fingerprint == m.fingerprint
    assert len(m.fingerprint) == 64 and int(m.fingerprint, 16) >= 0
    assert m.explain_mismatch(m.summary()) == (
        "the item list has the same size and ends, but an item's key, count or fingerprint changed"
    )


@SETTINGS
@given(manifests(), st.data())
def test_fingerprint_changes_with_key_count_or_item_fingerprint(m: Manifest, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(m.items) - 1))
    item = m.items[i]
    taken = {it.key for it in m.items}
    new_key = data.draw(keys.filter(lambda k: k not in taken))
    new_count = data.draw(st.integers(1, 2000).filter(lambda c: c != item.num_samples))
    new_fp = data.draw(st.text(max_size=6).filter(lambda f: f != item.fingerprint))
    for changed in (
        replace_item(m, i, key=new_key),
        replace_item(m, i, num_samples=new_count),
        replace_item(m, i, fingerprint=new_fp),
    ):
        assert changed.fingerprint != m.fingerprint


@SETTINGS
@given(manifests())
def test_fingerprint_depends_on_item_order(m: Manifest) -> None:
    reordered = Manifest(m.items[::-1])
    if reordered.items != m.items:
        assert reordered.fingerprint != m.fingerprint


def test_fingerprint_is_unambiguous_when_fields_contain_separators() -> None:
    """Two different manifests must not share a fingerprint, whatever characters keys and fingerprints hold."""
    one = Manifest((Item("a", 1, "x\nb\t2\t"),))
    two = Manifest((Item("a", 1, "x"), Item("b", 2, "")))
    assert one.items != two.items
    assert one.fingerprint != two.fingerprint


def test_explain_mismatch_names_what_changed() -> None:
    m = Manifest((Item("a", 3), Item("b", 4), Item("c", 5)))
    saved = m.summary()
    assert "total was 12, now 13" in replace_item(m, 1, num_samples=5).explain_mismatch(saved)
    msg = replace_item(m, 0, key="z").explain_mismatch(saved)
    assert "first_key was 'a', now 'z'" in msg and "total" not in msg
    assert "last_key was 'c', now 'q'" in replace_item(m, 2, key="q").explain_mismatch(saved)
    msg = Manifest((*m.items, Item("d", 1))).explain_mismatch(saved)
    assert "num_items was 3, now 4" in msg and "total was 12, now 13" in msg and "last_key was 'c', now 'd'" in msg
    # Same size and ends: fall back to the generic sentence.
    msg = replace_item(m, 1, fingerprint="new").explain_mismatch(saved)
    assert "an item's key, count or fingerprint changed" in msg
    # A summary from an older checkpoint with fields missing still gets an explanation.
    assert "num_items was None, now 3" in m.explain_mismatch({"fingerprint": "f"})


def test_empty_manifest_is_rejected() -> None:
    with pytest.raises(ValueError, match="manifest is empty"):
        Manifest(())
    with pytest.raises(ValueError, match="manifest is empty"):
        Manifest.from_items(iter([]))


def test_all_zero_counts_are_rejected_naming_an_item() -> None:
    with pytest.raises(ValueError, match=r"all 2 items hold 0 samples \(first item: 'shard-0.tar'\)"):
        Manifest((Item("shard-0.tar", 0), Item("shard-1.tar", 0)))


@pytest.mark.parametrize("count", [-1, 2.5, "3", None, True, np.float64(3.0)])
def test_bad_count_is_rejected_naming_the_item(count: object) -> None:
    with pytest.raises(ValueError, match=r"item 'bad.parquet' has num_samples="):
        Manifest((Item("good.parquet", 3), Item("bad.parquet", count)))  # type: ignore[arg-type]


def test_numpy_integer_counts_are_accepted() -> None:
    m = Manifest((Item("a", np.int64(3)), Item("b", np.int32(2))))  # type: ignore[arg-type]
    assert m.total == 5
    assert m.fingerprint == Manifest((Item("a", 3), Item("b", 2))).fingerprint


def test_duplicate_keys_are_rejected_naming_the_item() -> None:
    with pytest.raises(ValueError, match=r"item 'x/1.tar' appears twice"):
        Manifest((Item("x/1.tar", 3), Item("x/2.tar", 1), Item("x/1.tar", 2)))


def test_zero_count_items_are_allowed_next_to_non_empty_ones() -> None:
    m = Manifest((Item("a", 0), Item("b", 4)))
    assert m.total == 4 and m.counts.tolist() == [0, 4]
