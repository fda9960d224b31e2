"""The meta backend: a folder whose ``manifest.yaml`` says ``meta: true`` and whose ``model.py``
orchestrates other models of the server (Triton's BLS / ensembles, with nereid's deadline rule).

See the README section "Meta models" and :mod:`nereid.backends.meta.model`.
"""
