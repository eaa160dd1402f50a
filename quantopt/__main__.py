"""`python -m quantopt ...`: the `quantopt` command, for an environment whose scripts folder is not on PATH."""
import sys

from .cli import main

sys.exit(main())
