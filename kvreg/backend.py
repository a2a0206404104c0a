"""The attention and seal interfaces: what a backend computes.

A backend is an object with the kernels below. The NumPy reference
(:class:`kvreg.reference.ReferenceBackend`) implements every one of them; a
backend subclasses it and overrides what it accelerates, inheriting the rest.
``kvreg info`` lists, per backend, which kernels it implements natively
(:meth:`Backend.native_kernels`).

Arguments arrive validated by the core (the public edge): float32
C-contiguous arrays of the documented shapes, in-range indices. Kernels never
mutate storage; they return new arrays and accumulate only into the ``imp``
array they are handed.

Storage is a :class:`kvreg.storage.LayerStorage` (layout in docs/kernels.md).

Numerics contract (conformance checks it):

* exact class, bit-for-bit on every backend: ``quantize_rows``,
  ``freeze_field``, ``gather_rows``;
* within one backend, bit-for-bit: ``attend_group`` of a group == each head
  alone; ``attend_layer`` == ``attend_group`` per KV group; scoring
  ``[first, n)`` == the ``-inf``-masked full row; a trimmed layer == the
  untrimmed one; ``upto=i`` == the call when the layer held ``i`` rows;
* tolerance class against the f64 oracle: attention outputs, probabilities
  and importance, ``attend_chunk``, bounded and Nyström kernels.

Kernels:

``attend_group(q, st, g, *, scale, first, upto, softcap, sinks, imp) -> out``
    ``q [nh, hd]`` the Q heads of KV group ``g``; rows ``[first, n)`` of head
    ``g`` with ``n = min(lens[g], upto)`` are scored (``first < n`` or ``n ==
    0`` which gives zeros); ``sinks`` ``[nh]`` learned sink logits or None;
    ``imp`` (``[m]`` float32 or None) gets ``Σ_h prob[h, p]`` added for ``p``
    in ``[first, min(m, n))``, heads in order. Returns ``[nh, hd]`` float32.

``attend_layer(q, st, *, scale, window, softcap, sinks, imp) -> out``
    every KV group in one call: ``q [nh, hd]``, ``nh = hpk * nkv``, group
    ``g`` reads Q heads ``[g*hpk, (g+1)*hpk)``; ``first = max(0, n - window)``
    per group (``window`` None = 0). Must equal ``attend_group`` per group.

``attend_chunk(q, st, *, s0, b, hpk, scale, window, imp) -> out [b, nh, hd]``
    causal prefill of ``b`` rows already appended after ``s0``; row ``i``
    sees ``[max(0, s0+i+1-window), s0+i+1)``; ``imp`` gets the masked column
    sums. F32 K and V only, unless the backend sets ``native_q8_chunk = True``
    (otherwise the layer hands it a dequantized copy of the key range).

``quantize_rows(x, col, group) -> (q int8 [n, hd], s f32 [n, ceil(hd/group)])``
    ``col`` ``[hd]`` or ``[n, hd]`` or None; exact class (kvreg.quant).

``freeze_field(q, s, group) -> (col [hd], q2, s2)``
    the 2f freeze over one head's stored rows (``q [n, hd]`` int8, ``s [n,
    ceil(hd/group)]``): dequantize, RMS per channel summed in row order
    (floor 1e-6), requantize every row against it; exact class.

``gather_rows(rows, idx) -> rows[idx]``
    exact class.

``bounded_attend(...)``
    same signature and contract as :func:`kvreg.bounded.bounded_attend`.

``nystrom_prefill(...)``, ``nystrom_absorb(...)``, ``nystrom_step(...)``
    same signatures as in :mod:`kvreg.nystrom`; a sealed layer's
    :class:`~kvreg.nystrom.NystromState` calls them on its layer's backend.
"""

from __future__ import annotations

#: Every kernel a backend may implement.
KERNELS = (
    "attend_group",
    "attend_layer",
    "attend_chunk",
    "quantize_rows",
    "freeze_field",
    "gather_rows",
    "bounded_attend",
    "nystrom_prefill",
    "nystrom_absorb",
    "nystrom_step",
)


class Backend:
    """Base of every backend: a name, a device, and the kernel surface."""

    #: Registry name (``KVREG_BACKEND``).
    name = "abstract"
    #: Higher wins ``auto`` among backends that start on this machine.
    priority = 0
    #: Whether ``auto`` may pick it (CPU backends).
    auto = False
    #: Whether an O(1) seal may run its KV groups on threads (kernels that
    #: release the GIL and do not thread themselves).
    parallel_seal = False

    def __init__(self, device: str | None = None):
        self.device = device or "cpu"

    def describe(self) -> str:
        return f"{self.name} on {self.device}"

    @classmethod
    def devices(cls) -> list[str]:
        """Device specs this backend can run on here: each one a ``device``
        its constructor accepts (``kvreg conformance --backend all`` runs the
        suite once per entry). Raise BackendError, saying why, when none."""
        return ["cpu"]

    @classmethod
    def device_labels(cls) -> list[str]:
        """Human descriptions of :meth:`devices`, in the same order (``kvreg info``)."""
        return cls.devices()

    @classmethod
    def native_kernels(cls) -> list[str]:
        """Kernels this class (or a parent below the reference) defines itself."""
        from .reference import ReferenceBackend

        if issubclass(cls, ReferenceBackend) and cls is not ReferenceBackend:
            return [k for k in KERNELS if getattr(cls, k, None) is not getattr(ReferenceBackend, k, None)]
        return [k for k in KERNELS if hasattr(cls, k)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
