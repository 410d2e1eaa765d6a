"""A checkpoint's tensors by name, each read from its file only when popped (so that a model
takes them one at a time and nothing is held twice)."""
from __future__ import annotations


class LazyByName:
    """name -> tensor; subclasses fill `_where` (name -> where it lies) and `_load`."""

    def __init__(self):
        self._where: dict = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(list(self._where))

    def pop(self, name: str, *default):
        entry = self._where.pop(name, None)
        if entry is None:
            if default:
                return default[0]
            raise KeyError(name)
        return self._load(name, entry)

    def peek(self, name: str):
        """The tensor, left in place for a later pop (read again then)."""
        return self._load(name, self._where[name])

    def _load(self, name: str, entry):
        raise NotImplementedError
