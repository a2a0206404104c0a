"""pluggy entry point (group ``kvreg``, name ``opencl``): registers the
backend class without importing pyopencl; the device opens when the backend
is instantiated."""

from kvreg.hookspecs import hookimpl


@hookimpl
def kvreg_register_backends(register):
    from .backend import OpenCLBackend

    register(OpenCLBackend)
