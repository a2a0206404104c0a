"""The NumPy reference, registered exactly like a third-party plugin."""

from .hookspecs import hookimpl


@hookimpl
def kvreg_register_backends(register):
    from .reference import ReferenceBackend

    register(ReferenceBackend)
