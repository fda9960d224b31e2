"""The ``cpp`` backend: a folder with ``main.cpp``, compiled once at load into ``.cache/``."""
