"""Comparison helpers of the conformance suite (the ``check`` fixture).

``check.exact`` compares bit patterns (NaN-aware: a NaN matches a NaN of the
same payload; sign-of-zero-aware: ``-0.0 != +0.0``). ``check.close`` compares
with the tolerance of :mod:`kvreg_conformance.tolerances` declared for the kernel
and records the worst error seen per kernel (written to the side file named
by ``KVREG_CONFORMANCE_SIDE`` at the end of the session, for the
``kvreg conformance`` table). Failure messages name the kernel, the backend,
the device, the index, what was got and what was expected. Every helper hides
itself from pytest tracebacks.
"""

from __future__ import annotations

import numpy as np

from .tolerances import tolerance

#: kernel -> {"ratio": worst |err| / bound, "abs": worst |err|, "case": node id}
WORST: dict[str, dict] = {}


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return a.view(np.dtype(f"u{a.dtype.itemsize}"))
    return a


def _fmt(x) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{float(x)!r}"
    return repr(x.item() if hasattr(x, "item") else x)


class Checker:
    """Comparisons bound to the backend and device under test."""

    def __init__(self, backend_name: str, device: str, case: str = ""):
        self.backend = backend_name
        self.device = device
        self.case = case

    def _head(self, kernel: str, what: str) -> str:
        where = f" ({what})" if what else ""
        return f"kernel {kernel}{where} on backend {self.backend!r}, device {self.device!r}"

    def exact(self, kernel: str, got, expected, what: str = "") -> None:
        """Bit-for-bit equality of arrays or scalars (dtype and shape too)."""
        __tracebackhide__ = True
        g, e = np.asarray(got), np.asarray(expected)
        if g.shape != e.shape:
            raise AssertionError(f"{self._head(kernel, what)}: shape {g.shape}, expected {e.shape}")
        if g.dtype != e.dtype:
            raise AssertionError(f"{self._head(kernel, what)}: dtype {g.dtype}, expected {e.dtype}")
        gb, eb = _bits(np.ascontiguousarray(g)), _bits(np.ascontiguousarray(e))
        diff = gb != eb
        if diff.any():
            idx = tuple(int(i) for i in np.argwhere(diff)[0]) if g.ndim else ()
            gi, ei = g[idx], e[idx]
            bits = ""
            if g.dtype.kind == "f":
                bits = f" (bits {int(gb[idx]):#x} vs {int(eb[idx]):#x})"
            raise AssertionError(
                f"{self._head(kernel, what)}: not bit-identical at index {idx}: got {_fmt(gi)}, "
                f"expected {_fmt(ei)}{bits}; {int(diff.sum())} of {diff.size} elements differ")

    def close(self, kernel: str, got, expected, what: str = "", *, relative_to_max: bool = False) -> None:
        """``|got - expected| <= atol + rtol·|expected|`` with the kernel's
        declared tolerance (``relative_to_max``: ``rtol·max|expected|``, for
        the entries whose reason says so); NaN must sit exactly where NaN is
        expected."""
        __tracebackhide__ = True
        rtol, atol, _reason = tolerance(kernel)
        g = np.asarray(got, dtype=np.float64)
        e = np.asarray(expected, dtype=np.float64)
        if g.shape != e.shape:
            raise AssertionError(f"{self._head(kernel, what)}: shape {g.shape}, expected {e.shape}")
        gn, en = np.isnan(g), np.isnan(e)
        if (gn != en).any():
            idx = tuple(int(i) for i in np.argwhere(gn != en)[0])
            raise AssertionError(f"{self._head(kernel, what)}: NaN mismatch at index {idx}: got {_fmt(g[idx])}, "
                                 f"expected {_fmt(e[idx])}")
        with np.errstate(invalid="ignore"):
            err = np.where(gn, 0.0, np.abs(g - e))
            err = np.where(np.isinf(e) & (g == e), 0.0, err)
        mag = np.abs(np.where(en, 0.0, e))
        if relative_to_max:
            mag = np.full_like(mag, mag.max(initial=0.0))
        bound = atol + rtol * mag
        ratio = err / bound
        self._record(kernel, float(err.max(initial=0.0)), float(ratio.max(initial=0.0)))
        bad = ~(err <= bound)
        if bad.any():
            idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(np.where(bad, ratio, -1))), g.shape))
            raise AssertionError(
                f"{self._head(kernel, what)}: beyond tolerance (rtol={rtol:g}, atol={atol:g}) at index {idx}: "
                f"got {_fmt(g[idx])}, expected {_fmt(e[idx])}, |err|={err[idx]:.3g}; "
                f"{int(bad.sum())} of {bad.size} elements out of tolerance")

    def equal(self, kernel: str, got, expected, what: str = "") -> None:
        """Plain equality of Python values (counts, lengths, flags)."""
        __tracebackhide__ = True
        if got != expected:
            raise AssertionError(f"{self._head(kernel, what)}: got {got!r}, expected {expected!r}")

    def _record(self, kernel: str, abs_err: float, ratio: float) -> None:
        w = WORST.get(kernel)
        if w is None or ratio > w["ratio"]:
            WORST[kernel] = {"ratio": ratio, "abs": abs_err, "case": self.case}


# ── storage comparison (exact class) ──

def _written_rows(st, block: str) -> np.ndarray:
    """Per head, how many leading rows of a row block hold data, as the
    storage says (``written_rows``): q4's int4 blocks up to its int4 tier,
    q2's 2-bit blocks and a q8 side with a float16 window up to the window,
    every other block all its rows."""
    return st.written_rows(block)


def assert_same_storage(check: Checker, got_layer, want_layer, kernel: str, what: str = "") -> None:
    """Two layers hold bit-identical storage: per-head rows of every block,
    lens, seq_len, base, importance, the frozen q8 fields and exact rows."""
    __tracebackhide__ = True
    a, b = got_layer.storage, want_layer.storage
    check.exact(kernel, a.lens, b.lens, f"{what}: lens")
    check.equal(kernel, (got_layer.seq_len, got_layer.base), (want_layer.seq_len, want_layer.base),
                f"{what}: (seq_len, base)")
    check.exact(kernel, a.imp, b.imp, f"{what}: importance")
    if a.block_names() != b.block_names() or a.head_block_names() != b.head_block_names():
        raise AssertionError(f"kernel {kernel} ({what}): the layers store different blocks")
    if a.window:
        check.exact(kernel, a.b8, b.b8, f"{what}: float16 window bounds")
    if a.b4 is not None:
        check.exact(kernel, a.b4, b.b4, f"{what}: int4 tier bounds")
    for name in a.block_names():
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            if (x is None) != (y is None):
                raise AssertionError(f"kernel {kernel} ({what}): block {name} allocated in one layer only")
            continue
        # Only written rows: a window row's integer slot (q8, q2) and a q4
        # row above the int4 tier are unwritten.
        upto = _written_rows(a, name)
        for h in range(a.num_kv_heads):
            n = int(upto[h])
            check.exact(kernel, x[h, :n], y[h, :n], f"{what}: {name} of head {h}")
    for name in a.head_block_names():
        x, y = getattr(a, name), getattr(b, name)
        if name.startswith("th"):
            for h in range(a.num_kv_heads):
                n = int(a.lens[h] - a.b8[h])
                check.exact(kernel, x[h, :n], y[h, :n], f"{what}: {name} (float16 window) of head {h}")
        elif name.startswith("t8"):
            for h in range(a.num_kv_heads):
                n = int(a.b8[h] - a.b4[h])
                check.exact(kernel, x[h, :n], y[h, :n], f"{what}: {name} (int8 tier) of head {h}")
    check.exact(kernel, a.kcol_set, b.kcol_set, f"{what}: kcol_set")
    check.exact(kernel, a.vcol_set, b.vcol_set, f"{what}: vcol_set")
    for h in range(a.num_kv_heads):
        if a.kcol_set[h]:
            check.exact(kernel, a.kcol[h], b.kcol[h], f"{what}: kcol of head {h}")
        if a.vcol_set[h]:
            check.exact(kernel, a.vcol[h], b.vcol[h], f"{what}: vcol of head {h}")
    check.exact(kernel, a.xlen, b.xlen, f"{what}: q8 exact row counts")
    for name in ("xk", "xv"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            raise AssertionError(f"kernel {kernel} ({what}): exact rows {name} present in one layer only")
        for h in range(a.num_kv_heads if x is not None else 0):
            n = int(a.xlen[h])
            check.exact(kernel, x[h, :n], y[h, :n], f"{what}: {name} of head {h}")
