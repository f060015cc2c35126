"""The lower bound of a config field, checked where a frozen config is built (`__post_init__`).

One wording for such checks: "<field> must be >= <bound>, got <value>", the field named as its
users know it (a config field or a flag). The gateway's, routing's, the launcher's and loadgen's
workload use it; preprocess's config keeps its own wording ("must be positive"), which its
users and tests already read.
"""

from __future__ import annotations


def check_at_least(field: str, value: float, bound: float, note: str = "") -> None:
    """Raise ValueError unless `value` >= `bound`; `note` follows the bound (e.g. " (0: no bound)")."""
    if value < bound:
        raise ValueError(f"{field} must be >= {bound}{note}, got {value}")
