"""The baseline: a bare grpc.aio servicer that echoes ModelInfer inputs as outputs.

It answers just what perf_analyzer asks before it sends (ServerMetadata,
ModelMetadata, ModelConfig), and ModelInfer and ModelStreamInfer (--streaming), and nothing more: no validation, no queue, no
numpy. It is the limit of Python gRPC on this machine for the same messages.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from nereid._proto import grpc_service_pb2 as pb
from nereid._proto import model_config_pb2 as mc


def make_handler(shape: list[int], max_batch_size: int) -> grpc.GenericRpcHandler:
    batch = [-1] if max_batch_size else []

    async def server_metadata(request, context):
        return pb.ServerMetadataResponse(name="bare", version="0")

    async def model_metadata(request, context):
        response = pb.ModelMetadataResponse(name=request.name, versions=["1"], platform="bare")
        response.inputs.add(name="input", datatype="FP32", shape=batch + shape)
        response.outputs.add(name="output", datatype="FP32", shape=batch + shape)
        return response

    async def model_config(request, context):
        config = mc.ModelConfig(name=request.name, platform="bare", max_batch_size=max_batch_size)
        config.input.add(name="input", data_type=mc.TYPE_FP32, dims=shape)
        config.output.add(name="output", data_type=mc.TYPE_FP32, dims=shape)
        return pb.ModelConfigResponse(config=config)

    async def model_infer(request, context):
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for tensor in request.inputs:
            response.outputs.add(name="output", datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.extend(request.raw_input_contents)
        return response

    async def model_stream_infer(requests, context):
        # perf_analyzer --streaming: one answer per request, each in a ModelStreamInferResponse.
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=await model_infer(request, context))

    handlers = {
        "ServerMetadata": (server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": (model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelConfig": (model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelInfer": (model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
    }
    methods = {name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                         response_serializer=resp.SerializeToString)
               for name, (fn, req, resp) in handlers.items()}
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        model_stream_infer, request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString)
    return grpc.method_handlers_generic_handler("inference.GRPCInferenceService", methods)


async def serve(bind: str, shape: list[int], max_batch_size: int) -> None:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 1 << 30),
                                      ("grpc.max_receive_message_length", 1 << 30)])
    server.add_generic_rpc_handlers((make_handler(shape, max_batch_size),))
    server.add_insecure_port(bind)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], [int(d) for d in sys.argv[2].split(",")], int(sys.argv[3])))
