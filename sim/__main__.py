"""`python -m sim run TRACE ...` / `python -m sim sweep TRACE --rates ...` (see sim/cli.py)."""
import sys

from sim.cli import main

sys.exit(main())
