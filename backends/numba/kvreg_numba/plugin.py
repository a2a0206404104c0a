"""The pluggy entry point of kvreg-numba (group ``kvreg``, name ``numba``).

Registration only imports :mod:`kvreg_numba.backend`, which does not import
numba: a machine without a working numba still lists the backend and gets a
clear :class:`kvreg.errors.BackendError` when it asks for it.
"""

from kvreg.hookspecs import hookimpl


@hookimpl
def kvreg_register_backends(register):
    from .backend import NumbaBackend

    register(NumbaBackend)
