"""Schema fields generated from the Python API, so a Hydra schema and the class it configures have one
definition of each option and its default: a strategy's constructor (``sharding=``), a mixture's
:class:`~lightning_sharding.mixture.Stream` and :class:`~lightning_sharding.mixture.Phase`, and the
:class:`~lightning_sharding.tokens.Packing` of ``data=pretrain``."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import MISSING


def config_type(hint: Any) -> Any:
    """``hint`` as OmegaConf types it: ``Literal[...]`` -> ``str``, ``X | None`` -> ``Optional[X]``, a
    union with ``str`` (a function or its dotted path) -> ``str``, ``Mapping[K, V]`` -> ``dict[K, V]``,
    ``tuple[X, ...]`` -> ``list[X]``."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        inner: Any = str if str in args or len(args) > 1 else config_type(args[0])
        return typing.Optional[inner] if type(None) in typing.get_args(hint) else inner  # noqa: UP045 - a runtime type
    if origin in (Mapping, dict):
        key, value = (config_type(a) for a in typing.get_args(hint))
        return dict[key, value]  # type: ignore[valid-type]
    if origin is tuple and len(typing.get_args(hint)) == 2 and typing.get_args(hint)[1] is Ellipsis:
        return list[config_type(typing.get_args(hint)[0])]  # type: ignore[misc]
    return hint if hint in (int, float, str, bool) else Any


def fields_of(api: type, skip: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """The fields of the dataclass ``api`` (less ``skip``), typed as a config holds them, with ``api``'s
    defaults: for :func:`dataclasses.make_dataclass`. A field ``api`` requires (no default) is
    OmegaConf's ``MISSING`` (``???``): the option's YAML gives it, or the config fails naming it."""
    hints = typing.get_type_hints(api)
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(api):
        if f.name in skip:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = dataclasses.field(default=MISSING if required else f.default, default_factory=f.default_factory)
        out.append((f.name, config_type(hints[f.name]), default))
    return out


def with_fields_of(api: type, skip: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator: the schema, with ``api``'s fields (less ``skip``) after its own (:func:`fields_of`)."""

    def generate(schema: type) -> type:
        made = dataclasses.make_dataclass(schema.__name__, fields_of(api, skip), bases=(schema,))
        made.__doc__ = f"{schema.__doc__}\n\n    Generated fields, as {api.__name__} defines them: " + ", ".join(
            f"``{name}``" for name, _, _ in fields_of(api, skip)
        )
        made.__module__, made.__qualname__ = schema.__module__, schema.__qualname__
        return made

    return generate
