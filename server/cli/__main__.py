"""`python -m kvkeeper.server.cli`: the `kvkeeper` command (tests and deploy files run it so)."""
import sys

from .main import main

sys.exit(main())
