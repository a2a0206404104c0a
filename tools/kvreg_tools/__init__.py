"""kvreg-tools: kvreg's benchmarks, demo and evaluation harness.

Kept apart from the ``kvreg`` cache library so the library's wheel carries the
cache only. Installing this distribution adds the ``bench``, ``eval``,
``generate`` and ``demo`` subcommands to the ``kvreg`` command (entry-point
group ``kvreg.commands``, see :mod:`kvreg_tools.cli`).

Modules: :mod:`~kvreg_tools.bench` (``kvreg bench``; ``--model``:
:mod:`~kvreg_tools.model_bench`), :mod:`~kvreg_tools.evaluation` (``kvreg
eval``), :mod:`~kvreg_tools.generate` (``kvreg generate``),
:mod:`~kvreg_tools.demo` (``kvreg demo``). ``import kvreg_tools`` imports
nothing heavy.
"""

__version__ = "0.1.0"
