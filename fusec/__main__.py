"""`python -m fusec ...`: the same command line as the `fusec` console script."""
import sys

from fusec.cli import main

if __name__ == "__main__":
    sys.exit(main())
