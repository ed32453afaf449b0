"""`python -m realexec ...`: see realexec.cli."""
from realexec.cli import main

raise SystemExit(main())
