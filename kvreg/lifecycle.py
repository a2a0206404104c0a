"""Where a layer is in its life (:attr:`kvreg.LayerKvCache.lifecycle`).

::

    PLAIN ──o1_begin──▶ COLLECTING ──o1_seal──▶ SEALED ──o1_recollect──▶ COLLECTING
      │                     │ a seal that cannot proceed
      │                     ▼
      │                  FAILED  (appends refused)
      └──install_bounded──▶ BOUNDED

``clear()`` and a wire import take any state back to PLAIN (BOUNDED stays
BOUNDED: the ring is the layer's for good). Hosts branch on this one value
instead of probing flags.
"""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    #: rows stored per position and attended exactly (``append``, ``attend_layer``)
    PLAIN = "plain"
    #: an O(1) seal is armed: rows stored, the prompt's queries recorded
    COLLECTING = "collecting"
    #: sealed: sinks, window and far field per group; decode through ``o1_step``
    SEALED = "sealed"
    #: a fixed ring (``install_bounded``): nothing stored per position
    BOUNDED = "bounded"
    #: a seal aborted: the error is latched (``take_o1_error``), appends are
    #: refused until ``clear()``
    FAILED = "failed"
