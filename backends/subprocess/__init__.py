"""The language-agnostic subprocess tensor contract, shared by the python and cpp backends."""
