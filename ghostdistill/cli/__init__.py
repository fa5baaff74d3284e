"""The command line: `python -m ghostdistill <command>` (or the installed `ghostdistill` script).

    fit      --config <yaml> [overrides]       calibrate, fit the operators, distil (with max_steps > 0), evaluate
    compare  <compare.yaml> [fit overrides]    one `fit` per plan, gathered into one report
    export   <run> --views ... [--dir D]       write views of a finished run as Hugging Face folders / GGUF files
             [--overwrite] [--format hf gguf] [--trust-remote-code]  (a run's config runs no code without the flag)
    frontier <frontier.yaml> [fit overrides]   per depth, streamline's and the repair-aware plans (with `greedy`,
                                               plans of any shape grown from the depth before), evaluated;
                                               with `students`, a stock and an operator student trained per depth

`fit` is `runner.fit.run_fit`. Bad input ends in one line `error: ...` and exit status 2 (`GHOSTDISTILL_DEBUG=1`
shows the traceback); Ctrl-C outside `fit` (export, compare's gathering) in one line and exit status 130.
"""

from __future__ import annotations

import os
import sys

from ..core.errors import USER_ERRORS, one_line
from ..runner.fit import check_strategy_config as check_strategy_config
from ..runner.fit import run_fit
from .export import load_run_config as load_run_config
from .export import run_export
from .runs import run_compare, run_frontier_command

COMMANDS = {
    "fit": "calibrate, fit every method's operators, distil the students (trainer.max_steps > 0), evaluate",
    "compare": "run one fit per plan of a compare file and gather them into one report",
    "export": "write views of a finished run as Hugging Face model folders and GGUF files (llama.cpp)",
    "frontier": "for n = 1 … N blocks removed: every method on streamline's plan and on its repair-aware plan "
    "(with `greedy`, also plans grown block by block from the depth before; with `students`, the best stock and "
    "operator views fine-tuned)",
}


def usage() -> str:
    head = "usage: python -m ghostdistill <command> [arguments]   (<command> --help for its arguments)"
    return "\n".join([head, "", "commands:", *(f"  {name:<9} {text}" for name, text in COMMANDS.items())])


def main(args: list[str] | None = None):
    """`python -m ghostdistill <command> ...` from Python: errors are raised as they are (see `entry`)."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    runners = {"fit": run_fit, "compare": run_compare, "export": run_export, "frontier": run_frontier_command}
    if argv[0] not in runners:
        print(f"error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    return runners[argv[0]](argv[1:])


def entry() -> None:
    """The `ghostdistill` script and `python -m ghostdistill`: bad input ends in one line `error: ...` and exit
    status 2; `GHOSTDISTILL_DEBUG=1` shows the traceback instead."""
    try:
        main()
    except (KeyboardInterrupt, *USER_ERRORS) as err:
        if os.environ.get("GHOSTDISTILL_DEBUG"):
            raise
        if isinstance(err, KeyboardInterrupt):
            # Lightning turns Ctrl-C inside `fit` into exit status 1 itself; elsewhere (export, compare's
            # gathering) it would be a traceback. Every file on disk is complete (written atomically).
            print(
                "interrupted (SIGINT): stopped; files on disk are complete, rerun the same command to resume",
                file=sys.stderr,
            )
            raise SystemExit(130) from None
        print(f"error: {one_line(err)}  (GHOSTDISTILL_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
