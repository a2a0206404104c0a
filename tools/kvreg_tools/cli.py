"""The ``kvreg`` subcommands kvreg-tools adds: ``generate``, ``eval``, ``bench``, ``demo``, ``report``.

Each ``register_*`` is an entry point of the group ``kvreg.commands``: core
:mod:`kvreg.cli` calls it with its subparsers action; it adds one subparser and
sets its handler (``func``). Registering imports nothing heavy: torch,
transformers and matplotlib load when a command runs.
"""

from __future__ import annotations


def _bench_words(args) -> list[str]:
    """The ``kvreg bench`` command line of ``args`` (a record's ``command``)."""
    words = ["kvreg", "bench"]
    if getattr(args, "model", None):
        words += ["--model", args.model]
        for flag in ("context", "steps", "repeats", "configs"):
            if getattr(args, flag, None) is not None:
                words += [f"--{flag}", str(getattr(args, flag))]
        words += ["--busy"] if getattr(args, "busy", False) else []
    elif getattr(args, "what", "all") != "all":
        words.append(args.what)
    for name in getattr(args, "backend", None) or []:
        words += ["--backend", name]
    return words + (["--quick"] if getattr(args, "quick", False) else [])


def _cmd_bench(args) -> int:
    import json

    from kvreg_tools.report import header

    start = header("bench", _bench_words(args))
    if getattr(args, "model", None):
        from kvreg_tools.model_bench import main as model_main

        rc = model_main(args)
    else:
        from kvreg_tools.bench import main as bench_main

        rc = bench_main(args)
    if rc == 0 and getattr(args, "json", None):
        # The benchmark's own figures, with what a record says of its run
        # (kvreg_tools.report): kind, system, command, date, the machine.
        with open(args.json) as fh:
            res = json.load(fh)
        res = {**start, **res, "machine": {**start["machine"], **res.get("machine", {})}}
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return rc


def _cmd_demo(args) -> int:
    from kvreg_tools.demo import main as demo_main

    return demo_main(args)


def _cmd_generate(args) -> int:
    from kvreg_tools.generate import main as generate_main

    return generate_main(args)


def _cmd_eval(args) -> int:
    from kvreg_tools.evaluation import main as eval_main

    return eval_main(args)


def _cmd_report(args) -> int:
    from kvreg_tools.report import main as report_main

    return report_main(args)


_MODEL_HELP = "a checkpoint directory (save_pretrained, with its tokenizer), a .gguf file or a bundled model"


def register_generate(sub) -> None:
    from kvreg.models import MODELS
    from kvreg_tools.generate import DEFAULT_PROMPT

    gp = sub.add_parser("generate", help="text from a real model through kvreg, beside DynamicCache")
    gp.add_argument("--model", default="smollm2-135m", metavar="NAME|DIR|FILE.gguf",
                    help=f"{_MODEL_HELP}: {', '.join(MODELS)} (default: %(default)s)")
    gp.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    gp.add_argument("--tokens", type=int, default=64)
    gp.add_argument("--kv", default=None, help="KV mode (default: KVREG_KV, else f32)")
    gp.add_argument("--backend", default=None, help="kvreg backend (default: KVREG_BACKEND, else auto)")
    gp.set_defaults(func=_cmd_generate)


def register_eval(sub) -> None:
    from kvreg.models import MODELS
    from kvreg_tools.evaluation import DEFAULT_CONFIGS

    ep = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of cache configs on a real model")
    ep.add_argument("--model", default="smollm2-135m", metavar="NAME|DIR|FILE.gguf",
                    help=f"{_MODEL_HELP}: {', '.join(MODELS)}, or all of those (default: %(default)s)")
    ep.add_argument("--text", action="append", default=None, metavar="FILE",
                    help="text file (repeatable; default: CPython's textwrap.py)")
    ep.add_argument("--configs", default=None,
                    help="comma-separated: KV modes, born:N, sinkwin:N, recent:N, snap:N, "
                         "o1:M:W:SINK[:HEAVY][+far2][+obsN], "
                         f"nystrom:M:W:SINK, X@MODE, dynamic, static (default: {DEFAULT_CONFIGS}; none with --budget)")
    ep.add_argument("--budget", default=None, metavar="FRACTIONS",
                    help="comma-separated fractions of the f32 cache's peak bytes (e.g. 0.06,0.125,0.25): score "
                         "kvreg's proposals for each and pick the best whose measured peak fits")
    ep.add_argument("--tokens", type=int, default=2048)
    ep.add_argument("--prefix", type=int, default=256)
    ep.add_argument("--backend", default=None)
    ep.add_argument("--json", default=None, metavar="FILE",
                    help="write the run as a benchmark record (kvreg report reads kvreg/results/*.json)")
    ep.add_argument("--md", default=None, metavar="FILE", help="write the markdown tables here too")
    ep.add_argument("--plot", default=None, metavar="FILE.png", help="KL against cache bytes")
    ep.add_argument("--no-progress", action="store_true")
    ep.set_defaults(func=_cmd_eval)


def register_report(sub) -> None:
    rp = sub.add_parser("report", help="docs/benchmarks.md from the benchmark records (kvreg/results, "
                                       "docs/results/peers)")
    rp.add_argument("--root", default=".", metavar="DIR", help="kvreg's repository (default: the current directory)")
    rp.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming the difference when regenerating would change the page")
    rp.set_defaults(func=_cmd_report)


def register_bench(sub) -> None:
    from kvreg.models import MODELS

    bp = sub.add_parser("bench", help="throughput against the machine's limits and peers")
    bp.add_argument("what", nargs="?", default="all", choices=["all", "decode"])
    bp.add_argument("--backend", action="append", default=None)
    bp.add_argument("--quick", action="store_true")
    bp.add_argument("--json", default=None, metavar="FILE")
    bp.add_argument("--plot", default=None, metavar="FILE.png")
    mg = bp.add_argument_group("a real model (kvreg_tools.model_bench)")
    mg.add_argument("--model", default=None, choices=list(MODELS),
                    help="decode and prefill in this model: kvreg beside DynamicCache and StaticCache")
    mg.add_argument("--context", type=int, default=None, help="prefilled tokens (default 4096; --quick 64)")
    mg.add_argument("--steps", type=int, default=None, help="greedy steps per config per round (default 16)")
    mg.add_argument("--repeats", type=int, default=None, help="round-robin rounds (default 3)")
    mg.add_argument("--configs", default=None,
                    help="comma-separated: kvreg:MODE, dynamic, static (default kvreg:f32,kvreg:q8,dynamic,static)")
    mg.add_argument("--busy", action="store_true",
                    help="run the decode rounds again beside a process spinning on a core, in the same run")
    bp.set_defaults(func=_cmd_bench)


def register_demo(sub) -> None:
    dp = sub.add_parser("demo", help="a small GPT-style decoder driving KvCache")
    dp.add_argument("--tokens", type=int, default=32)
    dp.add_argument("--prompt", type=int, default=256)
    dp.add_argument("--chunk", type=int, default=64)
    dp.add_argument("--kv", default=None, help="KV mode (a KVREG_KV value: f32, f16, bf16, q8, q4, ...)")
    dp.add_argument("--budget", type=int, default=None, help="Born eviction at this many rows")
    dp.add_argument("--o1", action="store_true", help="seal every layer with the O(1) Nyström state")
    dp.add_argument("--handoff", action="store_true", help="prefill in one process, decode in another")
    dp.add_argument("--layers", type=int, default=8)
    dp.set_defaults(func=_cmd_demo)
