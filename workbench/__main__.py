"""python -m workbench: the command line (workbench/cli/)."""
import sys

from workbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
