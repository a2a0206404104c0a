"""Combinatorial products split into tiers: every pair of values in the
default tier, the rest of the product in the full tier (``full_product``).

A bug that needs two parameters to line up (a mode and a chunking, a head
mask and a head size) shows in some pair; the default tier covers each pair
of values at least once in a handful of cases, and the full tier still runs
every combination.
"""

from __future__ import annotations

import itertools

import pytest


def _pairs(combo: tuple) -> set:
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2)}


def cover(*axes) -> list[tuple]:
    """A small set of index tuples into ``axes`` (each a sequence of values)
    holding every pair of values of every two axes: greedy, each step taking
    the combination that covers the most pairs not yet covered (the first
    such in product order, so the cover is the same on every run)."""
    combos = list(itertools.product(*(range(len(a)) for a in axes)))
    todo = set().union(*(_pairs(c) for c in combos)) if len(axes) > 1 else set()
    chosen = [] if todo else combos[:1]
    while todo:
        best = max(combos, key=lambda c: len(_pairs(c) & todo))
        chosen.append(best)
        todo -= _pairs(best)
    return chosen


def params(*axes, ids=None) -> list:
    """``pytest.param`` per combination of ``axes``' values: the pairwise
    cover unmarked, every other combination marked ``full_product``.
    ``ids``: per axis, a function of a value giving its id part, or None
    (pytest's own ids)."""
    default = set(cover(*axes))
    out = []
    for combo in itertools.product(*(range(len(a)) for a in axes)):
        values = tuple(a[i] for a, i in zip(axes, combo))
        cid = None
        if ids is not None:
            cid = "-".join(str(f(v)) if f else str(v) for f, v in zip(ids, values))
        marks = () if combo in default else (pytest.mark.full_product,)
        out.append(pytest.param(*values, id=cid, marks=marks))
    return out
