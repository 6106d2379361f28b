"""`python -m launch ...`: see `launch/__init__.py`."""
import sys

from launch import main

if __name__ == "__main__":
    sys.exit(main())
