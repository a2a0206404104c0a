"""Integrations of kvreg into other libraries' inference loops.

- :mod:`kvreg.integrations.transformers`: ``KvregCache``, a
  ``transformers.Cache`` whose attention runs on kvreg (extra ``kvreg[hf]``).
- :mod:`kvreg.integrations.ray`: prefill and decode workers as Ray actors,
  a sequence's cache shipped between them through the object store, a dead
  decode worker's sequence resumed elsewhere (extra ``kvreg[ray]``;
  docs/serving.md).

Nothing here is imported by ``import kvreg``.
"""
