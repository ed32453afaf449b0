"""`python -m sim run|sweep|compare|sharing TRACE ...` (see sim/cli.py)."""
import sys

from sim.cli import main

sys.exit(main())
