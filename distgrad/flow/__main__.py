"""``python -m distgrad.flow run.json [-o flow.png]``: draw a recorded run, or print its table."""

from __future__ import annotations

import argparse
import sys

from .draw import draw
from .flow_run import FlowRun


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distgrad.flow",
        description="Show the gradient norms recorded by distgrad.flow.",
    )
    parser.add_argument("run", help="the JSON file Recorder.save wrote")
    parser.add_argument("-o", "--out", help="write a PNG here instead of printing a table")
    args = parser.parse_args(argv)
    run = FlowRun.load(args.run)
    if args.out:
        draw(run, args.out)
        print(f"wrote {args.out}")
    else:
        print(run.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
