"""`python -m moeflow ...`: the same as the `moeflow` command."""

from __future__ import annotations

import sys

from .cli.app import main

if __name__ == "__main__":
    main(sys.argv[1:])
