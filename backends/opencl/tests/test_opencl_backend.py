"""The OpenCL backend registers through kvreg's plugin hook."""

from __future__ import annotations


def test_plugin_registers_opencl(dev):
    import kvreg_opencl.plugin
    from kvreg import registry

    registry.register_plugin(kvreg_opencl.plugin)
    try:
        be = registry.get_backend("opencl")
        assert be.name == "opencl"
        assert {"attend_group", "attend_layer", "attend_chunk", "quantize_rows"} <= set(be.native_kernels())
    finally:
        registry.unregister_plugin(kvreg_opencl.plugin)
