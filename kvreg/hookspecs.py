"""Plugin hooks of kvreg (pluggy project name ``kvreg``).

A backend distribution declares an entry point in the group ``kvreg`` whose
module implements :func:`kvreg_register_backends`. The NumPy reference
registers through the very same hook (``kvreg._reference_plugin``).
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("kvreg")
hookimpl = pluggy.HookimplMarker("kvreg")


@hookspec
def kvreg_register_backends(register: Callable[[type], None]) -> None:
    """Hand each backend class of this plugin to ``register``.

    ``register(cls)`` takes a subclass of :class:`kvreg.plugin.Backend`
    whose ``name`` is unique among installed backends. Registration must be
    cheap and must not import heavy dependencies (numba, pyopencl): import
    them when the backend is instantiated, and raise
    :class:`kvreg.errors.BackendError` there, saying why, if it cannot start.
    """
