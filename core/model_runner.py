"""How one loaded model runs a request, decided once at load: [preprocess →] queue [→ postprocess].

A model without hooks runs a request by submitting it to its scheduler, and
nothing else; the data plane makes one call either way and never asks per
request which hooks a model has.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from nereid.backend import Model, Postprocesses, Preprocesses
from nereid.errors import InvalidArgument, ModelFailure, NereidError, same_kind
from nereid.scheduler import ModelScheduler
from nereid.signature import ModelSignature, check_outputs, validate_inputs
from nereid.tensors import NamedTensor

# run(inputs validated against the client-facing signature, their batch size, absolute deadline_ns) -> outputs
Runner = Callable[[list[NamedTensor], int, int], Awaitable[list[NamedTensor]]]


def make_runner(backend: Model, signature: ModelSignature, batch_signature: ModelSignature,
                scheduler: ModelScheduler) -> Runner:
    """The request path of one loaded model."""
    preprocess = backend.preprocess if isinstance(backend, Preprocesses) else None
    postprocess = backend.postprocess if isinstance(backend, Postprocesses) else None
    if preprocess is None and postprocess is None:
        return scheduler.submit

    async def run(inputs: list[NamedTensor], batch_size: int, deadline_ns: int) -> list[NamedTensor]:
        name = scheduler.name  # a renamed model reports its new name
        if preprocess is not None:
            inputs = await _call_hook(name, "preprocess", preprocess, inputs)
            inputs = _program_inputs(name, batch_signature, inputs)
            if batch_signature.batches and inputs:
                batch_size = inputs[0].shape[0]
        outputs = await scheduler.submit(inputs, batch_size, deadline_ns)
        if postprocess is not None:
            outputs = await _call_hook(name, "postprocess", postprocess, outputs)
            check_outputs(name, signature, outputs, batch_size)
        return outputs

    return run


def _program_inputs(model: str, batch_signature: ModelSignature, tensors: list[NamedTensor]) -> list[NamedTensor]:
    """The preprocess hook's result checked against the program's inputs.

    The client's request was valid (it was checked against the client tensors),
    so a result that does not fit is the model's fault: INTERNAL, naming the
    hook, never INVALID_ARGUMENT about a tensor the client never sent.
    """
    try:
        return validate_inputs(model, batch_signature, tensors).tensors
    except InvalidArgument as err:
        detail = str(err).removeprefix(f"model '{model}': ")
        raise ModelFailure(f"model '{model}': the preprocess hook returned tensors the program cannot take: "
                           f"{detail}") from None


async def _call_hook(model: str, hook: str, function: Callable[[list[NamedTensor]], list[NamedTensor]],
                     tensors: list[NamedTensor]) -> list[NamedTensor]:
    # Hooks run on worker threads, so hooks of different requests overlap.
    try:
        return await asyncio.to_thread(function, tensors)
    except NereidError as err:
        if str(err).startswith(f"model '{model}'"):
            raise
        # A hook's own refusal (InvalidArgument, ...): same kind, naming the model as every message does.
        raise same_kind(err, f"model '{model}': {err}") from err
    except Exception as err:
        raise ModelFailure(f"model '{model}': {hook} hook failed: {type(err).__name__}: {err}") from err
