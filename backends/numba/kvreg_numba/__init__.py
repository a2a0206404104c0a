"""kvreg-numba: the Numba CPU backend of kvreg.

Importing this package does not compile anything; kernels compile on first
use (and are cached on disk, see :mod:`kvreg_numba.config`).
"""

__version__ = "0.1.0"
