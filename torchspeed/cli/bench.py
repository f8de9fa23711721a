"""`torchspeed bench`: measure every technique against plain PyTorch on this machine."""
from __future__ import annotations

import argparse
import logging

from torchspeed.bench.suites import SUITE_NAMES
from torchspeed.cli import UserError, add_json_option


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure each technique's speed-up over plain PyTorch here (the report)",
                       description="Run the benchmark suites, each in its own process, and write report.md, the "
                                   "plots and results.json into --out. This machine's ceilings (GEMM per precision, "
                                   "memory bandwidth, JPEG decode per core) are measured first (cached per machine) "
                                   "and every data, train and infer row says what % of its ceiling it reaches. A suite "
                                   "that fails or crashes is reported as failed; the others still run and the report "
                                   "is still written.")
    p.add_argument("suite", nargs="?", default="all", choices=(*SUITE_NAMES, "all"), help="which suite (default all)")
    p.add_argument("--quick", action="store_true",
                   help="fewer contenders and shorter measurement windows, each suite within its share of a few "
                        "minutes (the plan printed first gives each budget); the ceilings are read from this machine's "
                        "cache (what `make demo` runs)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="print every suite's table after the summary, as in the report (shown anyway on a console "
                        "at least 150 columns wide)")
    p.add_argument("--refresh-ceilings", action="store_true",
                   help="measure this machine's ceilings again even with --quick (a ceiling keeps the best of its "
                        "measurements: run it on a quiet machine)")
    p.add_argument("--out", default="torchspeed-report", metavar="DIR", help="report directory (default ./torchspeed-report)")
    p.add_argument("--report-only", metavar="DIR",
                   help="run nothing: write report.md and the plots again from DIR/results.json")
    add_json_option(p)
    p.set_defaults(func=run, log_level=logging.WARNING)  # the suites print their own progress; -v shows more


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        if args.suite != "all" or args.quick or args.json or args.refresh_ceilings:
            raise UserError("--report-only DIR renders an existing results.json; it takes no suite, --quick, "
                            "--refresh-ceilings or --json")
        from torchspeed.bench.orchestration import render_report

        render_report(args.report_only, verbose=getattr(args, "verbose", False))
        return 0
    from torchspeed.bench.orchestration import run_suites

    names = SUITE_NAMES if args.suite == "all" else (args.suite,)
    results = run_suites(names, quick=args.quick, out=args.out, json_path=args.json, command=_command(args),
                         refresh_ceilings=args.refresh_ceilings, verbose=getattr(args, "verbose", False))
    failed = [n for n in names if isinstance(results.get(n), dict) and "error" in results[n]]
    return 1 if failed else 0


def _command(args: argparse.Namespace) -> str:
    """The command line as the report records it."""
    return " ".join(["torchspeed bench", args.suite] + ["--quick"] * args.quick
                    + ["--refresh-ceilings"] * args.refresh_ceilings + ["--out", args.out]
                    + (["--json", args.json] if args.json else []))
