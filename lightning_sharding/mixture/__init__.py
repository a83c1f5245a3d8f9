"""Mixtures: several streams read as one epoch order, at chosen shares and batch compositions.

The flow inside: ``streams`` (the user's ``Stream`` and the ``MixtureReader`` over them) ->
``order`` (``Mixture``, ``MixtureOrder``: a mixture position to a stream's draw and item) ->
``interleave`` and ``composition`` (where each stream's draws sit, and blocked batches) ->
``change`` (the rest of an epoch resumed under another mixture) and ``control`` (shares decided
while training runs). Code outside this folder imports
from here, never from the modules inside. Names load lazily, so importing the package is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "COMPOSITIONS": "composition",
    "ChangedMixture": "change",
    "ControlledMixture": "control",
    "Decision": "control",
    "check_shares": "control",
    "epoch_decisions": "control",
    "static_decisions": "control",
    "change_of": "order",
    "mixture_of": "order",
    "Mixture": "order",
    "MixtureChange": "change",
    "MixtureChangeError": "change",
    "MixtureOrder": "order",
    "MixtureReader": "streams",
    "SHARES": "order",
    "Stream": "streams",
    "StreamSpec": "order",
    "change_mixture": "change",
    "changed_counts": "change",
    "check_blocks": "composition",
    "layout": "composition",
    "layout_of_summary": "control",
    "Phase": "schedule",
    "plan_draws": "order",
    "reader_of": "streams",
    "shown_key": "streams",
}

__all__ = [
    "COMPOSITIONS",
    "ChangedMixture",
    "ControlledMixture",
    "Decision",
    "check_shares",
    "epoch_decisions",
    "static_decisions",
    "change_of",
    "mixture_of",
    "Mixture",
    "MixtureChange",
    "MixtureChangeError",
    "MixtureOrder",
    "MixtureReader",
    "SHARES",
    "Stream",
    "StreamSpec",
    "change_mixture",
    "changed_counts",
    "check_blocks",
    "layout",
    "layout_of_summary",
    "Phase",
    "plan_draws",
    "reader_of",
    "shown_key",
]

if TYPE_CHECKING:
    from lightning_sharding.mixture.change import (
        ChangedMixture,
        MixtureChange,
        MixtureChangeError,
        change_mixture,
        changed_counts,
    )
    from lightning_sharding.mixture.composition import COMPOSITIONS, check_blocks, layout
    from lightning_sharding.mixture.control import (
        ControlledMixture,
        Decision,
        check_shares,
        epoch_decisions,
        layout_of_summary,
        static_decisions,
    )
    from lightning_sharding.mixture.order import (
        SHARES,
        Mixture,
        MixtureOrder,
        StreamSpec,
        change_of,
        mixture_of,
        plan_draws,
    )
    from lightning_sharding.mixture.schedule import Phase
    from lightning_sharding.mixture.streams import MixtureReader, Stream, reader_of, shown_key


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sharding.mixture' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_sharding.mixture.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
