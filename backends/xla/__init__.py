"""The StableHLO/XLA bundle backend: ``manifest.yaml`` + ``model*.mlir`` + ``weights.safetensors``.

A bundle's program is a StableHLO portable artifact that jaxlib's PJRT client
compiles for the model's device; see the README section "StableHLO/XLA bundles".
Nothing here imports jax at import time: the plugin only looks at files, and
jax is imported when a bundle is loaded.
"""
