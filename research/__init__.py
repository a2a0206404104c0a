"""Research scripts behind kvreg's storage formats and its O(1) seal (README.md
here). Nothing shipped or tested by default imports them; run them from the
repository root (``python -m research.NAME``)."""
