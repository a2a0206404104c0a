"""The kernel boundary: what a backend computes, on what it reads.

A backend is a subclass of :class:`Backend` registered through the ``kvreg``
pluggy hook (:mod:`kvreg.hookspecs`). Its **core kernels** are abstract
here, each with its full signature and contract: the attends
(``attend_group``, ``attend_layer``, ``attend_batch``, ``attend_chunk``) and
the exact class (``quantize_rows``, ``freeze_field``, ``gather_rows``,
``rotate_rows``). Its **optional capabilities** (:data:`CAPABILITIES`: the
bounded ring, the Nyström seal, the tiered seal's step, the fused decode)
are methods whose bodies here are the reference's; a backend declares in
:attr:`Backend.provides` those it accelerates and overrides their kernels.
:class:`kvreg.reference.ReferenceBackend` implements every core kernel in
NumPy, and a backend usually subclasses it and overrides what it
accelerates (``docs/writing-a-backend.md``).

One argument style: the data a kernel reads come first, positionally
(query arrays, a read-only view of the layer's rows, far-field state), every
parameter after them is keyword-only. Kernels never write what they read:
views hold read-only arrays, far-field state is returned, not mutated; a
kernel writes only the outputs it is handed (the ``imp`` accumulator, a
fused decode's :class:`~kvreg.views.DecodeSlot`).

Views (:class:`~kvreg.views.KvView`, :class:`~kvreg.views.RingView`) are
frozen snapshots of a layer's storage or bounded ring at one ``version``,
which moves on every mutation of what they describe, so a device mirror
keyed on ``version`` alone is never stale. A KvView's rows come in groups,
one per kind of storage (float rows, int8 rows, exact rows, the float16
window, q4's tiers). Counts (lengths, window bounds, flags) are copies taken
at that version; row arrays are read-only views of the owner's.

Numerics contract (the conformance suite checks it):

* exact class, bit for bit on every backend: ``quantize_rows``,
  ``freeze_field``, ``gather_rows``, ``rotate_rows``;
* within one backend, bit for bit: ``attend_group`` of a group == each head
  alone; ``attend_layer`` == ``attend_group`` per KV group; ``attend_batch``
  == ``attend_layer`` per sequence; scoring ``[first,
  n)`` == the ``-inf``-masked full row; a trimmed layer == the untrimmed one;
  ``upto=i`` == the call when the layer held ``i`` rows; the same bits at
  any thread count and compile-cache state;
* tolerance class against the float64 oracle (one table,
  :mod:`kvreg_conformance.tolerances`): attention outputs, probabilities and
  importance, ``attend_chunk``, bounded and Nyström kernels.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import numpy as np

from . import bounded, nystrom, tiered_seal
from .modes import KvMode
from .views import DecodeSlot, KvView, RingView

#: The kernels every backend implements (abstract on :class:`Backend`).
CORE_KERNELS = (
    "attend_group",
    "attend_layer",
    "attend_batch",
    "attend_chunk",
    "quantize_rows",
    "freeze_field",
    "gather_rows",
    "rotate_rows",
)

#: The optional capabilities, each the kernels of one feature. A backend
#: declares those it accelerates (:attr:`Backend.provides`) and overrides
#: some of their kernels; every other one runs the reference's NumPy code,
#: which is what :class:`Backend`'s own methods for them are.
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "bounded_ring": ("bounded_attend",),
    "nystrom": ("nystrom_prefill", "nystrom_absorb", "nystrom_step"),
    "tiered_seal": ("tiered_attend",),
    "fused_decode": ("append_attend_layer", "prepare_append_attend", "store_window_row"),
}

#: Every kernel (``kvreg info`` says which a backend runs natively); the
#: fused decode's hooks are paths, not kernels of their own.
KERNELS = CORE_KERNELS + tuple(k for cap, ks in CAPABILITIES.items() if cap != "fused_decode" for k in ks)


def check_batch(q, kvs, imps) -> tuple[np.ndarray, list]:
    """:meth:`Backend.attend_batch`'s arguments checked as a native kernel
    needs them: ``q [B, nh, hd]`` float32 for ``B`` views of one mode,
    ``num_kv_heads`` and ``head_dim`` (``nh`` a multiple of the KV heads), and
    one accumulator entry per sequence when ``imps`` is given. Returns
    ``(q, kvs)`` (a list; empty for an empty batch); a ShapeError otherwise."""
    from .errors import ShapeError

    kvs = list(kvs)
    q = np.asarray(q, dtype=np.float32)
    if q.ndim != 3 or q.shape[0] != len(kvs):
        raise ShapeError(f"attend_batch: q must be [{len(kvs)}, nh, hd], got {q.shape}")
    if imps is not None and len(imps) != len(kvs):
        raise ShapeError(f"attend_batch: {len(imps)} importance accumulators for {len(kvs)} sequences")
    if not kvs:
        return q, kvs
    kv0 = kvs[0]
    mode, nkv, hd = kv0.mode, kv0.num_kv_heads, kv0.head_dim
    for kv in kvs:
        if kv.mode is not mode or kv.num_kv_heads != nkv or kv.head_dim != hd:
            raise ShapeError("attend_batch: every sequence must share mode, num_kv_heads and head_dim "
                             f"({kv.mode.value}/{kv.num_kv_heads}/{kv.head_dim} vs {mode.value}/{nkv}/{hd})")
    if q.shape[2] != hd or q.shape[1] % nkv:
        raise ShapeError(f"attend_batch: q is {q.shape}, the layers hold {nkv} KV heads of {hd}")
    return q, kvs


class Backend(abc.ABC):
    """Base of every backend: a name, a device, declared capabilities and the
    kernels. Subclass :class:`kvreg.reference.ReferenceBackend` to inherit a
    correct NumPy implementation of every kernel."""

    # ── declarations (class attributes; kvreg info and the conformance suite read them) ──

    #: Registry name (``KVREG_BACKEND``, ``--kvreg-backend``).
    name: ClassVar[str] = "abstract"
    #: Higher wins ``auto`` among backends that start on this machine.
    priority: ClassVar[int] = 0
    #: Whether ``auto`` may pick it (CPU backends that need no device choice).
    auto: ClassVar[bool] = False
    #: The Nyström kernels release the GIL and do not thread themselves, so an
    #: O(1) seal may run its KV groups on threads.
    parallel_seal: ClassVar[bool] = False
    #: ``attend_chunk`` reads q8 storage itself (without it the layer hands
    #: the kernel a widened float32 view of the key range).
    native_q8_chunk: ClassVar[bool] = False
    #: KV modes whose rows the attention kernels read natively (the rest run
    #: the reference's arithmetic inside the backend's own override).
    native_modes: ClassVar[frozenset[KvMode]] = frozenset()
    #: Keeps device copies of storage, keyed on :attr:`KvView.version`.
    device_resident: ClassVar[bool] = False
    #: This backend's list of known conformance gaps, as a package resource
    #: ``"package:relative/path.txt"`` (format: conformance/README.md).
    conformance_xfail: ClassVar[str | None] = None
    #: True on the NumPy reference only: its kernels are nobody's native ones.
    is_reference: ClassVar[bool] = False
    #: The optional capabilities (:data:`CAPABILITIES`) whose kernels this
    #: backend accelerates; registration refuses a declaration its class
    #: does not back with an override, and an override it does not declare.
    provides: ClassVar[frozenset[str]] = frozenset()

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
    def _is_the_reference(cls) -> bool:
        # a subclass of the reference inherits its kernels, not its standing
        return bool(cls.__dict__.get("is_reference", False))

    @classmethod
    def _overrides(cls, names) -> list[str]:
        """Of ``names``, the methods this class defines, or a parent of it
        other than the reference and this base (theirs are the reference's)."""
        out = []
        for k in names:
            owner = next((c for c in cls.__mro__ if k in c.__dict__), Backend)
            if owner is not Backend and (owner is cls or not owner.__dict__.get("is_reference", False)):
                out.append(k)
        return out

    @classmethod
    def native_kernels(cls) -> list[str]:
        """Kernels this backend runs natively (every one, on the reference)."""
        return list(KERNELS) if cls._is_the_reference() else cls._overrides(KERNELS)

    @classmethod
    def declaration_error(cls) -> str | None:
        """Why :attr:`provides` does not match the class (None when it does):
        an unknown capability, a declared one none of whose kernels the
        class overrides, or an override of a capability it does not declare."""
        if cls._is_the_reference():
            return None
        unknown = sorted(set(cls.provides) - set(CAPABILITIES))
        if unknown:
            return f"provides unknown capabilities {', '.join(unknown)} (known: {', '.join(CAPABILITIES)})"
        for cap, kernels in CAPABILITIES.items():
            overridden = cls._overrides(kernels)
            if cap in cls.provides and not overridden:
                return f"declares {cap!r} but overrides none of its kernels ({', '.join(kernels)})"
            if overridden and cap not in cls.provides:
                return f"overrides {', '.join(overridden)} without declaring {cap!r} in provides"
        return None

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The declarations above, as ``kvreg info`` prints them."""
        return {
            "native_kernels": cls.native_kernels(),
            "native_modes": sorted(m.value for m in cls.native_modes),
            "provides": sorted(CAPABILITIES) if cls._is_the_reference() else sorted(cls.provides),
            "parallel_seal": cls.parallel_seal,
            "native_q8_chunk": cls.native_q8_chunk,
            "device_resident": cls.device_resident,
        }

    @classmethod
    def capability_lines(cls) -> list[str]:
        """The declarations as ``kvreg info`` and the conformance header print them."""
        caps = cls.capabilities()
        native, modes, provides = caps.pop("native_kernels"), caps.pop("native_modes"), caps.pop("provides")
        flags = [k for k, v in caps.items() if v]
        return [f"native kernels: {', '.join(native) or 'none (inherits the reference)'}",
                f"native KV modes: {', '.join(modes) or 'none (the reference reads every mode)'}",
                f"capabilities: {', '.join(provides) or 'none (the reference runs them)'}",
                f"declares: {', '.join(flags) or 'nothing beyond the kernels'}"]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def small_tunables(self) -> AbstractContextManager | None:
        """Optional: a context manager inside which this backend's tunables
        (block sizes, work-group sizes, tiles) take small values, so that
        the conformance suite's inputs of a few dozen rows run its
        multi-block paths; None (this default) when it has none. Every
        invariant and tolerance of the contract holds at any tunables: the
        suite runs its invariant and oracle cases at both."""
        return None

    # ── attention over a layer's rows ──

    @abc.abstractmethod
    def attend_group(self, q: np.ndarray, kv: KvView, g: int, *, scale: float, first: int = 0,
                     upto: int | None = None, softcap: float = 0.0, sinks: np.ndarray | None = None,
                     imp: np.ndarray | None = None) -> np.ndarray:
        """Decode attention of KV group ``g``: ``q [nh, hd]`` float32 are the
        group's Q heads; rows ``[first, n)`` of head ``g`` with ``n =
        min(lens[g], upto)`` are scored (``first < n``, or ``n == 0`` which
        gives zeros), times ``scale``, tanh-capped at ``softcap`` when > 0;
        ``sinks [nh]`` learned sink logits join each softmax (or None).
        ``imp [m]`` float32 (or None) gets ``Σ_h prob[h, p]`` added for ``p``
        in ``[first, min(m, n))``, heads in order. Returns ``[nh, hd]``
        float32. Every head is scored on its own (a group == its heads)."""

    @abc.abstractmethod
    def attend_layer(self, q: np.ndarray, kv: KvView, *, scale: float, window: int | None = None,
                     softcap: float = 0.0, sinks: np.ndarray | None = None,
                     imp: np.ndarray | None = None) -> np.ndarray:
        """Every KV group in one call: ``q [nh, hd]``, ``nh = hpk * nkv``,
        group ``g`` reads Q heads ``[g*hpk, (g+1)*hpk)`` with ``first =
        max(0, lens[g] - window)`` (``window`` None or 0: all rows). Must equal
        :meth:`attend_group` per group bit for bit."""

    @abc.abstractmethod
    def attend_batch(self, q: np.ndarray, kvs: Sequence[KvView], *, scale: float, window: int | None = None,
                     softcap: float = 0.0, sinks: np.ndarray | None = None,
                     imps: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
        """One layer of ``B`` sequences in one call (batched decode): ``q [B,
        nh, hd]`` float32, ``kvs`` the ``B`` sequences' views of that layer
        (one mode, ``num_kv_heads`` and ``head_dim``; their lengths differ),
        ``sinks [B, nh]`` or None, ``imps`` one accumulator (or None) per
        sequence, or None. Returns ``[B, nh, hd]`` float32 whose row ``b``
        equals :meth:`attend_layer` of ``q[b]`` over ``kvs[b]`` (with
        ``sinks[b]``, ``imps[b]``) bit for bit. A sequence with no rows
        answers zeros."""

    @abc.abstractmethod
    def attend_chunk(self, q: np.ndarray, kv: KvView, *, s0: int, b: int, hpk: int, scale: float,
                     window: int | None = None, imp: np.ndarray | None = None) -> np.ndarray:
        """Causal prefill: ``q [b, nh, hd]`` are the queries of rows ``s0 ..
        s0+b-1``, already stored; row ``i`` attends rows ``[max(0,
        s0+i+1-window), s0+i+1)`` of its group. ``imp`` gets the masked column
        sums. Returns ``[b, nh, hd]`` float32. ``kv`` is float32 K and V unless
        :attr:`native_q8_chunk` (the layer hands over a widened view)."""

    # ── the exact class ──

    @abc.abstractmethod
    def quantize_rows(self, x: np.ndarray, col: np.ndarray | None, *, group: int) -> tuple[np.ndarray, np.ndarray]:
        """Int8 rows of ``x [n, hd]`` float32 divided by ``col`` (``[hd]``,
        ``[n, hd]`` or None) with one float32 scale per ``group`` channels:
        ``(q int8 [n, hd], s float32 [n, ceil(hd/group)])``, bit for bit
        :func:`kvreg.quant.quantize_rows` (ties away from zero)."""

    @abc.abstractmethod
    def freeze_field(self, q: np.ndarray, s: np.ndarray, *, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The 2f freeze of one head's stored rows (``q [n, hd]`` int8, ``s [n,
        ceil(hd/group)]``): dequantize, RMS per channel summed in row order
        (floor 1e-6), requantize every row against it: ``(col [hd], q2,
        s2)``, bit for bit :func:`kvreg.quant.freeze_field`."""

    @abc.abstractmethod
    def gather_rows(self, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``rows[idx]`` (``idx`` ascending int64), bit for bit."""

    @abc.abstractmethod
    def rotate_rows(self, x: np.ndarray) -> np.ndarray:
        """The orthonormal Walsh-Hadamard transform of the rows ``x [..., hd]``
        (``hd`` a power of two), float32, a new array: bit for bit
        :func:`kvreg.quant.fwht` (butterflies in its order, then the scale).
        The rotated modes (q8, q8k, q8v, q4) run it on every append (the new
        rows) and every attend (the query, and the output back)."""

    def store_window_row(self, k: np.ndarray, v: np.ndarray, *, rot_k: bool, rot_v: bool, thk, thv, kq, ks,
                         vq, vs, kf, vf, lens: np.ndarray, b8: np.ndarray, imp: np.ndarray, seq: int,
                         exact_cap: int) -> bool:
        """``fused_decode``: the decode append of a q8 (q8k, q8v) storage whose float16
        window is full, in one call. ``k``/``v`` ``[nkv, hd]`` float32 as the
        layer got them. First check that state (every head holds the same
        count ``n >= exact_cap``, and ``b8`` is ``n - w`` on every head, ``w``
        the window's rows), then write what
        :meth:`kvreg.storage.Int8Storage.append_window_row` writes, bit for
        bit: each quantized side (``thk``/``thv`` float16 ``[nkv, w, hd]``,
        None when the side is float32 ``kf``/``vf``) refuses a value beyond
        ±1e18 or NaN, is rotated when ``rot_*`` (:meth:`rotate_rows`), its
        window's oldest row quantized into integer slot ``b8[0]`` of
        ``kq``/``ks`` (groups of 32) or ``vq``/``vs`` (one group), the window
        moved up and the new row stored last; a float32 side's row goes to
        slot ``lens[0]``; then ``lens`` and ``b8`` grow by one and
        ``imp[seq] = 0``. Return False, having written nothing, to refuse or
        to leave the row to the layer's general path (this default)."""
        return False

    def append_attend_layer(self, k: np.ndarray, v: np.ndarray, q: np.ndarray, slot: DecodeSlot, *,
                            imp: np.ndarray, seq: int,
                            owner, scale: float, window: int | None = None, softcap: float = 0.0,
                            sinks: np.ndarray | None = None, importance: bool = False,
                            out: np.ndarray | None = None) -> np.ndarray | None:
        """``fused_decode``: a decode step in one call. ``slot``
        (:class:`~kvreg.views.DecodeSlot`) is an F32, f16, bf16 or q8 (q8k,
        q8v) storage's rows, writable, with a free slot for the row; the
        step writes into it and ``imp[seq]`` (its importance slot) and
        nothing else; ``owner`` is the rows' identity, whose ``row_memo`` is
        the backend's (as ``memo`` is for views).

        F32, f16, bf16: check that every head holds the same count ``n``,
        write what :meth:`kvreg.storage.DenseStorage.append_row` writes
        (``k``/``v`` ``[nkv, hd]`` float32, rounded as
        :func:`kvreg.quant.to_half` rounds for a 2-byte storage, to slot
        ``n`` of every head, ``lens`` one up, ``imp[seq] = 0``); a finite
        value a 2-byte format rounds to inf is declined (None: the layer's
        ``append`` refuses it). q8: :meth:`store_window_row`'s checks and
        writes. Then answer :meth:`attend_layer` of ``q`` over the rows with
        the new one, bit for bit (for q8 in the rotated basis where a side
        rotates, as ``LayerKvCache`` does with :meth:`rotate_rows`),
        accumulating importance into ``imp[:seq + 1]`` when ``importance``,
        into ``out`` (float32 ``[nh, hd]``) when given. Return None, having
        written nothing, to leave the step to ``append`` and
        ``attend_layer`` (this default)."""
        return None

    def prepare_append_attend(self, slot: DecodeSlot, *, owner, shape: tuple[int, int], scale: float,
                              window: int | None = None,
                              softcap: float = 0.0, sinks: np.ndarray | None = None, importance: bool = False,
                              out: np.ndarray | None = None):
        """``fused_decode``: :meth:`append_attend_layer` prepared once for a run of
        decode steps (:class:`kvreg.DecodeStep`): a callable ``step(k, v, q,
        imp, seq)`` that does what ``append_attend_layer(k, v, q, slot,
        imp=imp, seq=seq, ...)`` with these arguments does (queries of
        ``shape`` ``(nh, hd)``; the answer in ``out``, allocated here when
        None), or None for no prepared step. The caller calls it only while
        the storage has changed through the step's own calls since it was
        made (it checks the storage's version): a step may keep what it read
        from ``slot``, the row count included. This default binds
        :meth:`append_attend_layer`'s arguments (None when that hook is the
        base class's)."""
        if type(self).append_attend_layer is Backend.append_attend_layer:
            return None
        if out is None:
            out = np.empty(shape, np.float32)

        def step(k, v, q, imp, seq):
            return self.append_attend_layer(k, v, q, slot, imp=imp, seq=seq, owner=owner, scale=scale, window=window,
                                            softcap=softcap, sinks=sinks, importance=importance, out=out)
        return step

    # ── optional capabilities: these bodies are the reference's ──

    def bounded_attend(self, q: np.ndarray, ring: RingView, *, scale: float, num_heads: int) -> np.ndarray:
        """``bounded_ring``: attend raw ``q [num_heads, hd]`` at position
        ``ring.seen - 1`` over each group's sinks and its newest ring rows,
        RoPE applied to the query and each row at its position: the contract
        of :func:`kvreg.bounded.bounded_attend`. Returns ``[num_heads, hd]``
        float32."""
        return bounded.bounded_attend(q, ring, scale=scale, num_heads=num_heads)

    def nystrom_prefill(self, probes: np.ndarray, k_far: np.ndarray, v_far: np.ndarray, *,
                        scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``nystrom``: far sums of probe queries ``probes [hpk, p, hd]`` over
        far rows ``k_far``/``v_far [n >= 1, hd]``: ``(c, z [hpk, p], theta
        [hpk, p, hd])`` float64 (:func:`kvreg.nystrom.nystrom_prefill`)."""
        return nystrom.nystrom_prefill(probes, k_far, v_far, scale)

    def nystrom_absorb(self, far: nystrom.FarField, k_row: np.ndarray, v_row: np.ndarray, *,
                       scale: float) -> nystrom.FarField:
        """``nystrom``: the far field after one more row (leaving the window)
        joined it: a new :class:`~kvreg.nystrom.FarField`; ``far`` is not
        modified (:func:`kvreg.nystrom.nystrom_absorb`)."""
        return nystrom.nystrom_absorb(far, k_row, v_row, scale)

    def nystrom_step(self, q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                     far: nystrom.FarField | None, *, scale: float) -> np.ndarray:
        """``nystrom``: one sealed decode read of a group: ``q_group [hpk, hd]``
        over the exact rows ``k_exact``/``v_exact [e >= 1, hd]`` plus the far
        estimate: ``[hpk, hd]`` float32 (:func:`kvreg.nystrom.nystrom_step`)."""
        return nystrom.nystrom_step(q_group, k_exact, v_exact, far, scale)

    def tiered_attend(self, q: np.ndarray, tiers, *, scale: float) -> tuple[np.ndarray, list[np.ndarray]]:
        """``tiered_seal``: the attention of a tiered seal's decode step,
        ``q [nkv, hpk, hd]`` float32 over its tiers' rows under one softmax:
        ``(out [nkv, hpk, hd], mass)``, the contract of
        :func:`kvreg.tiered_seal.tiered_attend`."""
        return tiered_seal.tiered_attend(q, tiers, scale=scale)
