"""kvreg's conformance suite: what a backend must pass on a device.

Run it with ``python -m pytest conformance --kvreg-backend NAME
[--kvreg-device SPEC]`` or ``kvreg conformance --backend NAME``. The suite is
run against a backend, never edited for one: known gaps are data
(``conformance/xfail/<backend>.txt``), tolerances live in one table
(:mod:`conformance.tolerances`).
"""
