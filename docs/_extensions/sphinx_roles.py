"""A griffe extension for the API reference: Sphinx roles in docstrings become code spans.

The package's docstrings name other objects the Sphinx way (``:class:`~lightning_sharding.core.plan.RankPlan```),
which Markdown would show as it is. This turns each role into a code span of the name, shortened
after a ``~`` as Sphinx does: `RankPlan`.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def code_span(match: re.Match[str]) -> str:
    """```name``` for ``:role:`name```, and only the last part of ``~a.b.name``."""
    short, name = match.group(1), match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every loaded object's docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called by griffe for each object it loads."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(code_span, obj.docstring.value)
