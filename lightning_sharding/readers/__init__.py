"""Readers turn items into samples; each reader is one small module with the same interface."""

from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.synthetic import SyntheticReader

__all__ = ["Reader", "SyntheticReader"]
