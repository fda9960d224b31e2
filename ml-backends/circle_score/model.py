"""circle_score: select the points inside a circle, then score each selected point with the MLP.

Data-dependent logic between the two models: no MLP call at all when nothing
was selected, and one MLP call per 32 selected points (its largest compiled
batch), issued concurrently.
"""

import asyncio

import numpy as np

import nereid
from nereid.tensors import NamedTensor

MLP_ROWS = 32  # mlp_bundle's largest compiled batch size


def features(points: np.ndarray) -> np.ndarray:
    """16 Fourier features per point, the MLP's input: sin and cos of 1x..4x each coordinate."""
    scaled = np.concatenate([points * k for k in (1, 2, 3, 4)], axis=1)  # [n, 8]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)  # [n, 16]


async def orchestrate(inputs, ctx):
    (points,) = inputs
    (selected,) = await ctx.infer("circle_select", [NamedTensor.from_array("points", points.data)])
    inside = selected.data
    if len(inside) == 0:  # nothing to score: the second model is not called
        scores = np.zeros((0, 4), np.float32)
    else:
        rows = features(inside)
        chunks = [rows[start:start + MLP_ROWS] for start in range(0, len(rows), MLP_ROWS)]
        results = await asyncio.gather(*(ctx.infer("mlp_bundle", [NamedTensor.from_array("input", chunk)])
                                         for chunk in chunks))
        scores = np.concatenate([output.data for (output,) in results])
    return [NamedTensor.from_array("selected", inside), NamedTensor.from_array("scores", scores)]


nereid.register_model(orchestrate=orchestrate)
