"""kvreg's conformance suite: what a backend must pass on a device.

Install it with ``pip install kvreg[conformance]`` and run it with ``python -m
pytest --pyargs kvreg.conformance --kvreg-backend NAME [--kvreg-device SPEC]``
or ``kvreg conformance --backend NAME``. The suite is
run against a backend, never edited for one: known gaps are data
(``kvreg/conformance/xfail/<backend>.txt``), tolerances live in one table
(:mod:`kvreg.conformance.tolerances`).
"""
