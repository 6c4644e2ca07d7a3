"""`python -m occult.cli ...` is `occult ...` (as is `python -m occult ...`)."""

import sys

from occult.cli import main

if __name__ == "__main__":
    sys.exit(main())
