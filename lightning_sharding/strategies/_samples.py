"""Sample errors: what failed, named, and why a sample does not fit in a batch with the others."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_sharding.core.spelling import option


class SampleError(RuntimeError):
    """A sample that could not be read or transformed; the message names the item and the sample."""


@dataclass(frozen=True)
class Failed:
    """Stands in a sample that failed under ``on_error="skip"``; ``message`` says which and why."""

    message: str

    def error(self) -> SampleError:
        """The error to raise under ``on_error="raise"``: the failure, and what to do about it."""
        return SampleError(
            f"{self.message} Fix or remove the data, or pass {option('on_error', 'skip')} to skip bad samples "
            "(counted and reported)."
        )


def structure(sample: Any) -> Any:
    """A hashable summary of a sample's layout: the shape and dtype of every array, the type of the rest."""
    if isinstance(sample, Mapping):
        return ("dict", tuple((str(k), structure(v)) for k, v in sample.items()))
    if isinstance(sample, (list, tuple)):
        return ("seq", tuple(structure(v) for v in sample))
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        return ("array", tuple(sample.shape), str(sample.dtype))
    return ("type", type(sample).__name__)


def describe_structure(layout: Any) -> str:
    """``structure(sample)`` as text, e.g. ``{'x': shape (8,) float32, 'id': int}``."""
    kind = layout[0]
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {describe_structure(v)}" for k, v in layout[1]) + "}"
    if kind == "seq":
        return "(" + ", ".join(describe_structure(v) for v in layout[1]) + ")"
    if kind == "array":
        return f"shape {layout[1]} {layout[2]}"
    return str(layout[1])


def difference(layout: Any, common: Any) -> str:
    """How sample layout ``layout`` differs from ``common``, naming the fields of dict samples."""
    if layout[0] == common[0] == "dict":
        mine, theirs = dict(layout[1]), dict(common[1])
        return "; ".join(
            f"field {key!r} is {describe_structure(mine[key]) if key in mine else 'missing'}, "
            f"the other samples' is {describe_structure(theirs[key]) if key in theirs else 'missing'}"
            for key in dict.fromkeys([*mine, *theirs])
            if mine.get(key) != theirs.get(key)
        )
    return f"it is {describe_structure(layout)}, the other samples are {describe_structure(common)}"
