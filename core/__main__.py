"""``python -m nereid``: the ``nereid`` command, as the console script runs it (Triton's and MLServer's users try
this spelling first)."""

import sys

from nereid.entry import main

sys.exit(main())
