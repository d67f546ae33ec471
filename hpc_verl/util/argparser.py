"""The argument parser every entry point uses (``hpc-verl``, ``verl-scheduler-dashboard``).

It lives below the CLI so that tools under ``ops/`` (which must not import ``cli/``)
report usage errors the same way.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
