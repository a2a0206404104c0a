"""kvreg-opencl: OpenCL compute backend for kvreg (GPUs, and CPUs via PoCL).

Importing this package creates no OpenCL context: the device is chosen on
first use (:func:`kvreg_opencl.device.get_device`).
"""

__version__ = "0.1.0"
