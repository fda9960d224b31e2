"""The ``cxx`` backend: a native shared library called in-process through a small C ABI.

The ABI is declared in ``nereid_cxx.h``, shipped with this package
(``nereid cxx-header`` prints its path). Importing this package loads nothing:
the CLI finds the header through :mod:`importlib.resources` without pulling in
the backend's modules.
"""

HEADER_NAME = "nereid_cxx.h"
API_VERSION = 1  # NEREID_CXX_API_VERSION in the header: the ABI this server calls
