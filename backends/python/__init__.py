"""The ``python`` backend: a folder with ``main.py``, run by the server's own interpreter."""
