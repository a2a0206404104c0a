"""Test tiers of the kvreg checkout (CONTRIBUTING.md, "Test tiers").

The default tier (``make test``) holds what a change is likely to break and
runs in minutes on two cores. A test of a slow kind carries one of
:data:`FULL_TIER` and runs in the full tier only: profile ``full``
(``KVREG_PROFILE=full`` or ``--kvreg-profile=full``, the conformance suite's
own setting). ``make test-full`` selects just those markers, so ``make
test`` then ``make test-full`` run every test once.
"""

from __future__ import annotations

import pytest

from kvreg_conformance.plugin import profile

#: The slow kinds, each a registered marker (pyproject.toml) of the full tier.
FULL_TIER = ("real_models", "model_families", "cold_jit", "suite_meta", "long_fuzz", "full_product")


def pytest_collection_modifyitems(config, items):
    if profile(config) == "full":
        return
    keep, full = [], []
    for item in items:
        (full if any(item.get_closest_marker(m) for m in FULL_TIER) else keep).append(item)
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = keep


def pytest_report_header(config):
    if profile(config) == "full":
        return "kvreg profile full: every test"
    return f"kvreg profile {profile(config)}: the default tier ({' / '.join(FULL_TIER)} deselected)"


@pytest.fixture(scope="session")
def pretrained():
    """``get(name) -> (model, tokenizer)``: each pretrained model
    (:func:`kvreg.models.load`) loaded once per test session, whichever test
    files ask for it."""
    from kvreg.models import load

    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load(name)
        return loaded[name]
    return get
