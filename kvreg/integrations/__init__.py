"""Integrations of kvreg into other libraries' inference loops.

- :mod:`kvreg.integrations.transformers`: ``KvregCache``, a
  ``transformers.Cache`` whose attention runs on kvreg (extra ``kvreg[hf]``).

Nothing here is imported by ``import kvreg``.
"""
