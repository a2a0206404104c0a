"""kvreg-tools: kvreg's benchmarks, accuracy reports, demo and evaluation harness.

Kept apart from the ``kvreg`` cache library so the library's wheel carries the
cache only. Installing this distribution adds the ``bench``, ``eval``,
``generate`` and ``demo`` subcommands to the ``kvreg`` command (entry-point
group ``kvreg.commands``, see :mod:`kvreg_tools.cli`).

Modules: :mod:`~kvreg_tools.bench` (``kvreg bench``),
:mod:`~kvreg_tools.evaluation` (``kvreg eval``), :mod:`~kvreg_tools.generate`
(``kvreg generate``), :mod:`~kvreg_tools.demo` (``kvreg demo``),
:mod:`~kvreg_tools.o1_report` and :mod:`~kvreg_tools.q8_report` (accuracy
tables), :mod:`~kvreg_tools.realistic` (the synthetic Q/K/V generator and its
float64 oracle), :mod:`~kvreg_tools.real_attention` (captured real Q/K/V,
``data/real_qkv.npz``), :mod:`~kvreg_tools.kv_quant_study` (the storage-format
search). ``import kvreg_tools`` imports nothing heavy.
"""

__version__ = "0.1.0"
