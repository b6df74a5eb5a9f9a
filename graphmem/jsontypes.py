"""JSON-shaped data: what ``json.load`` gives back and ``json.dump`` writes (a report's ``to_dict``, a
DeepSpeed config), as one recursive type alias for the type checker."""
from __future__ import annotations

from typing import Union

JSON = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]

__all__ = ["JSON"]
