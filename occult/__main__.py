"""`python -m occult ...` runs the `occult` command line."""

import sys

from occult.cli import main

if __name__ == "__main__":
    sys.exit(main())
