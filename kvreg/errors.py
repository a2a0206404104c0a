"""kvreg's error hierarchy.

Every refusal of the public API is a :class:`KvregError`; the subclasses also
derive from the builtin a caller would naturally catch (``ValueError`` for a
bad argument or a bad wire blob, ``RuntimeError`` for a backend that cannot
start). A refused call changes nothing: validation always runs before the
first mutation.
"""

from __future__ import annotations


class KvregError(Exception):
    """Base class of every error kvreg raises on purpose."""


class ShapeError(KvregError, ValueError):
    """An array has the wrong shape, length or dtype for the call."""


class ConfigError(KvregError, ValueError):
    """A bad configuration value (an environment variable, a mode, a policy)."""


class WireError(KvregError, ValueError):
    """A wire blob that cannot be exported or imported (see docs/wire.md)."""

    #: The byte of the blob the refusal names (set where one is known).
    offset: int | None


class SealError(KvregError, ValueError):
    """An O(1) Nyström seal that cannot proceed, or a layer latched by one."""


class StateError(KvregError, RuntimeError):
    """An operation that the layer's current state does not allow."""


class BackendError(KvregError, RuntimeError):
    """A backend that is unknown, or that cannot start on this machine."""
