"""A host application using kvreg: a small GPT-style decoder (NumPy, seeded
random weights) that prefills a prompt in chunks and decodes greedily through
``kvreg.KvCache`` on the backend ``KVREG_BACKEND`` selects.

    python examples/host_app.py --tokens 32 --prompt 256
    KVREG_BACKEND=numba python examples/host_app.py --kv q8 --budget 192
    python examples/host_app.py --o1
    python examples/host_app.py --handoff      # prefill and decode in two processes

The model and the cache driving live in :mod:`kvreg_tools.demo` (also ``kvreg demo``).
"""

import sys

from kvreg.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
