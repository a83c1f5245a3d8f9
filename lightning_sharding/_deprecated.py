"""What the last releases renamed, still working for one release with a ``DeprecationWarning`` that names
the new spelling: module paths that moved (``lightning_sharding.keeper`` -> ``lightning_sharding.loading.keeper``),
names the package root no longer exports (``lightning_sharding.Ledger`` -> ``lightning_sharding.core.ledger``)
and names given a new word (``ShardContext`` -> ``WorkerContext``).
The CHANGELOG lists each; the next release removes them.

This module holds the old module paths and the root's old names. The other old spellings live beside
the code that answers them (the layers keep ``core/`` and ``readers/`` from importing this module, and
an old argument is best refused where the new one is read). Every place, for the release that removes
them (0.3):

- here: :data:`MOVED` (old module paths, ``recipes.stream`` among them), :data:`ROOT_NAMES` and
  :data:`RENAMED` (the root's old names); the package's ``__init__.py`` calls :func:`root_name`
  from its ``__getattr__`` and :func:`install` at import;
- ``core/world.py``: ``OLD_NAMES`` and ``old_name`` (``ShardContext``), ``SampleContext.shard`` and
  ``BatchContext.shard`` (``_old_shard``), ``WorkerContext.rank`` and ``.world_size`` (``_OLD_FIELDS``:
  the properties, the ``rank=``/``world_size=`` keywords, ``WorkerContext.__setstate__``);
- ``readers/base.py`` and ``readers/sources.py``: the ``__getattr__`` that answers ``ShardContext``;
- ``core/ledger.py``: ``Ledger.done``;
- ``loading/engine.py``: ``RENAMED`` (``strategy=``, ``data_root_map=``) and ``STRATEGY_SETTINGS``
  (``transport=``, ``prefetch_items=``), read by ``renamed_arguments`` and ``strategy_of``;
- ``lightning/datamodule.py``: ``ShardedDataModule(**renamed)`` (passes them to the engine) and the
  attribute ``dm.data_root_map`` (not warned);
- ``strategies/base.py``: ``_FLAGS``, ``_FLAG_REASONS`` and ``_adopt_flags`` (a strategy's flags of 0.1);
- ``train.py``: ``renamed_recipe`` and ``_INTERNAL_KEYS`` (the ``_renamed_recipe`` mark of
  ``conf/recipe/stream.yaml``, also read by ``cli/plan.py``; its field in ``config/schemas.py``),
  and ``MOVED_KEYS`` (refuses ``data.transport`` and ``sharding.strategy``, naming the new key: a
  message, not a deprecation, which may stay);
- ``conf/recipe/stream.yaml``: ``recipe=stream``;
- ``cli/plan.py``: ``plan --strategy`` (the old name of ``--sharding``, not warned);
- their tests: ``tests/unit/test_renamed_words.py`` and the old spellings' tests of ``test_public_surface.py``,
  ``test_old_checkpoints.py`` (old module paths), ``test_options_defined_once.py`` and ``test_strategies.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

_PACKAGE = "lightning_sharding"

# Old path under the package -> (new path, the release that moved it).
MOVED: dict[str, tuple[str, str]] = {
    "manifest": ("core.manifest", "0.2"),
    "order": ("core.order", "0.2"),
    "plan": ("core.plan", "0.2"),
    "rangeset": ("core.rangeset", "0.2"),
    "ledger": ("core.ledger", "0.2"),
    "world": ("core.world", "0.2"),
    "options": ("strategies.options", "0.2"),
    "streams": ("mixture.streams", "0.2"),
    "interleave": ("mixture.interleave", "0.2"),
    "composition": ("mixture.composition", "0.2"),
    "mixture_change": ("mixture.change", "0.2"),
    "lookahead": ("mixture.order", "0.2"),
    "datamodule": ("lightning.datamodule", "0.2"),
    "callbacks": ("lightning.callbacks", "0.2"),
    "keeper": ("loading.keeper", "0.2"),
    "accounting": ("loading.accounting", "0.2"),
    "progress_bar": ("lightning.progress_bar", "0.2"),
    "summary": ("loading.summary", "0.2"),
    "release": ("lightning.release", "0.2"),
    "restart": ("lightning.datamodule", "0.2"),
    "audit": ("loading.audit", "0.2"),
    "dali": ("lightning.dali", "0.2"),
    "_distributed": ("distributed.collectives", "0.2"),
    "agreement": ("loading.agreement", "0.2"),
    "segments": ("strategies._shared_memory", "0.2"),
    "processes": ("strategies._helper_deaths", "0.2"),
    "dispatcher": ("strategies._dispatch_process", "0.2"),
    "storage": ("readers.storage", "0.2"),
    "sources": ("readers.sources", "0.2"),
    "plots": ("cli.plots", "0.2"),
    "datasets": ("recipes.synthetic_files", "0.2"),
    # the Lightning-free loading engine (issue 52)
    "lightning.keeper": ("loading.keeper", "0.2"),
    "lightning.accounting": ("loading.accounting", "0.2"),
    "lightning.audit": ("loading.audit", "0.2"),
    "lightning.summary": ("loading.summary", "0.2"),
    "lightning.loop": ("loading.loop", "0.2"),
    "distributed.agreement": ("loading.agreement", "0.2"),
    # one word per meaning (issue 52): a stream is one source of a mixture
    "recipes.stream": ("recipes.sqlite", "0.2"),
}


# Names the root exported before and no longer does (issue 52): their homes. They still import from
# the root for one release, with a DeprecationWarning naming the home.
ROOT_NAMES: dict[str, str] = {
    "BatchTask": "core.plan",
    "DispatchLoader": "strategies.dispatch",
    "DocumentReader": "tokens",
    "EpochOrder": "core.order",
    "EpochPlan": "core.plan",
    "EpochReport": "loading.summary",
    "ExcessLossWeights": "lightning.controller",
    "FileReader": "readers",
    "Ledger": "core.ledger",
    "LoaderOptions": "strategies.options",
    "Manifest": "core.manifest",
    "Order": "core.order",
    "PackedReader": "tokens",
    "RangeSet": "core.rangeset",
    "RankPlan": "core.plan",
    "ReplicaMismatchError": "loading.keeper",
    "ShardContext": "core.world",
    "ShardedLoader": "strategies.shard",
    "Source": "readers.sources",
    "Strategy": "strategies",
    "StreamStats": "lightning.controller",
    "WindowedReader": "readers",
    "World": "core.world",
    "plan_epoch": "core.plan",
    "register_strategy": "strategies",
}


# Names given a new word in 0.2 (one word per meaning, issue 52) that the root exported: old name -> (its
# home, the new name). Their modules answer the old names themselves (``core.world.OLD_NAMES``: the
# layers keep the core and the readers from importing this module).
RENAMED: dict[str, tuple[str, str]] = {
    "ShardContext": ("core.world", "WorkerContext"),  # a shard is a file of the data set
}


# Tools that look for the shortest import path of an object by probing its parent modules: they must find
# its home, or what they save (LightningCLI's config.yaml, written by jsonargparse) names a path that the
# next release removes. They get an AttributeError for a dropped name, as from 0.3 on.
_PATH_PROBERS = ("jsonargparse.",)
_warned: set[str] = set()


def root_name(name: str, caller: str = "") -> Any:
    """``lightning_sharding.<name>`` for a name the root no longer exports, warned once; else (or when
    ``caller``, the calling module's name, is a tool that probes for import paths) an AttributeError."""
    home = ROOT_NAMES.get(name)
    if home is None or caller.startswith(_PATH_PROBERS):
        raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
    new = RENAMED[name][1] if name in RENAMED else name
    value = getattr(importlib.import_module(f"{_PACKAGE}.{home}"), new)
    if name in _warned:
        return value
    _warned.add(name)
    called = f" as {new}, its name since 0.2" if new != name else ""
    warnings.warn(
        f"lightning_sharding.{name} is no longer exported from the package root: import it from "
        f"{_PACKAGE}.{home}{called} (the root's name goes away in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``lightning_sharding.<old>`` as the module it moved to, warning once per import."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for a moved module's old path; ``None`` for every other name."""
        prefix, _, old = fullname.partition(".")
        if prefix != _PACKAGE or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """A throwaway module (the default) for importlib to stamp with the old path's spec: the new
        module keeps its own ``__spec__``, so ``importlib.reload`` of it reloads its own file."""
        return None

    def exec_module(self, module: ModuleType) -> None:
        """Put the new module itself under the old path, so classes and functions are the same objects
        under both; importlib returns what ``sys.modules`` holds under the old path once this returns."""
        new, release = MOVED[module.__name__.partition(".")[2]]
        new = f"{_PACKAGE}.{new}"
        warnings.warn(
            f"{module.__name__} moved to {new} in lightning_sharding {release}; import it from there "
            "(the old path goes away in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
