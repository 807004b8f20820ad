"""Checks of a live OpenAI-compatible server (vLLM) with kvkeeper, as commands.

    kvkeeper experiment prefix ...   prefix.py: seed 000 Step 5, unique vs shared prefix
    kvkeeper experiment report ...   report.py: its table and TTFT plot
    kvkeeper verify replay ...       replay.py: seed 003, restart and replay

Client side only: stdlib HTTP, no vLLM import. The daemon never imports this
package (kvkeeper.server.cli loads it when one of these commands runs).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = ("usage: kvkeeper experiment {prefix,report} ...\n"
         "  prefix   unique vs shared prefix on an OpenAI-compatible server (--help)\n"
         "  report   print a result's table, plot its TTFT distributions (--help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`kvkeeper experiment SUBCOMMAND ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prefix":
        from .prefix import main as prefix_main
        return prefix_main(argv[1:])
    if argv and argv[0] == "report":
        from .report import main as report_main
        return report_main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    sys.stderr.write(USAGE)
    return 2
