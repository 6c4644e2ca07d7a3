"""Expert weights between Megatron's two per-expert state-dict layouts.

`SequentialMLP` keys local expert `e`'s weights `...mlp.experts.local_experts.{e}.linear_fc1.weight`;
`TEGroupedMLP` (Transformer Engine's `GroupedLinear`, or occult's, `use_grouped_experts`) keys them
`...mlp.experts.linear_fc1.weight{e}`, the same [output, input] tensor. `to_grouped_expert_keys` and
`to_sequential_expert_keys` rename one into the other (a checkpoint of either loads into a model of the other);
every other key is kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SEQUENTIAL = re.compile(
    r"^(?P<stem>.*\.mlp\.experts\.)local_experts\.(?P<e>\d+)\.(?P<linear>linear_fc[12]\.(weight|bias))$"
)
GROUPED = re.compile(r"^(?P<stem>.*\.mlp\.experts\.)(?P<linear>linear_fc[12]\.(weight|bias))(?P<e>\d+)$")


def to_grouped_expert_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """SequentialMLP's per-expert keys -> TEGroupedMLP's (module docstring)."""
    return {_rename(k, SEQUENTIAL, "{stem}{linear}{e}"): v for k, v in state_dict.items()}


def to_sequential_expert_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """TEGroupedMLP's per-expert keys -> SequentialMLP's (module docstring)."""
    return {_rename(k, GROUPED, "{stem}local_experts.{e}.{linear}"): v for k, v in state_dict.items()}


def _rename(key: str, pattern: re.Pattern, form: str) -> str:
    m = pattern.match(key)
    return key if m is None else form.format(**m.groupdict())
