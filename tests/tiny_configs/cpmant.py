"""CPM-Ant: the keys its tiny checkpoint needs.

CPM-Ant spells its head width ``dim_head`` and its MLP width ``dim_ff``; its ``prompt_length``
learned prompt positions (32 by default) run before the input's tokens in every block.
"""

from typing import Any

OVERRIDES: dict[str, dict[str, Any]] = {"cpmant": {"dim_head": 32, "dim_ff": 256}}
