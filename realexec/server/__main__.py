"""`python -m realexec.server serve ...` / `python -m realexec.server bench serve ...`."""
from realexec.server.cli import main

raise SystemExit(main())
