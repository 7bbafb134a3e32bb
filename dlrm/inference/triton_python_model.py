"""The ``model.py`` of the python-backend deployment: runs the exported DLRM file in Triton's
python backend, for servers built without the ONNX Runtime or PyTorch backends.

The deployer copies this file, unchanged, into ``<repository>/<model>/<version>/model.py``.
It imports nothing from this project (the server's Python environment need not have it), only
numpy and ONNX Runtime for ``model.onnx`` or torch for ``model.pt``. Which file it runs and
the tensor names come from the model's ``config.pbtxt``.

Dynamic batching hands ``execute`` several requests at once; they are concatenated into one
forward pass and the result split back, so batching on the server pays off as with the native
backends.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

Runner = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _parameters(config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def _onnx_runner(path: str, gpu: bool, device_id: int, threads: int) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads > 0:
        options.intra_op_num_threads = threads
    providers: list = ["CPUExecutionProvider"]
    if gpu:
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))
    session = ort.InferenceSession(path, sess_options=options, providers=providers)
    numerical_name, categorical_name = (i.name for i in session.get_inputs())
    numerical_type = np.float16 if session.get_inputs()[0].type == "tensor(float16)" else np.float32
    output_name = session.get_outputs()[0].name

    def run(numerical: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        feeds = {numerical_name: numerical.astype(numerical_type, copy=False),
                 categorical_name: categorical.astype(np.int64, copy=False)}
        return session.run([output_name], feeds)[0]

    return run


def _torchscript_runner(path: str, gpu: bool, device_id: int, threads: int) -> Runner:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    device = torch.device("cuda", device_id) if gpu else torch.device("cpu")
    module = torch.jit.load(path, map_location=device).eval()

    def run(numerical: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = module(torch.from_numpy(numerical).to(device), torch.from_numpy(categorical).to(device, torch.int64))
        return out.float().cpu().numpy()

    return run


class TritonPythonModel:
    """Triton's python-backend entry point (``initialize``, ``execute``, ``finalize``)."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb_utils = pb_utils
        config = json.loads(args["model_config"])
        parameters = _parameters(config)
        model_file = parameters.get("model_file", "model.onnx")
        path = os.path.join(args["model_repository"], args["model_version"], model_file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{config['name']}: {path} not found (parameter model_file: {model_file!r})")
        gpu = args["model_instance_kind"] == "GPU"
        device_id = int(args["model_instance_device_id"])
        threads = int(parameters.get("intra_op_threads", "0"))
        make = _onnx_runner if model_file.endswith(".onnx") else _torchscript_runner
        self.run = make(path, gpu, device_id, threads)
        self.numerical_name, self.categorical_name = (i["name"] for i in config["input"])
        self.output_name = config["output"][0]["name"]

    def execute(self, requests: list) -> list:
        pb = self.pb_utils
        numerical, categorical = [], []
        for request in requests:
            numerical.append(pb.get_input_tensor_by_name(request, self.numerical_name).as_numpy())
            categorical.append(pb.get_input_tensor_by_name(request, self.categorical_name).as_numpy())
        try:
            probability = self.run(np.concatenate(numerical), np.concatenate(categorical))
        except Exception as e:  # every request of the batch gets the error, and the server lives on
            error = pb.TritonError(f"{type(e).__name__}: {e}")
            return [pb.InferenceResponse(output_tensors=[], error=error) for _ in requests]
        responses, start = [], 0
        for rows in (len(n) for n in numerical):
            part = np.ascontiguousarray(probability[start : start + rows], dtype=np.float32)
            responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(self.output_name, part)]))
            start += rows
        return responses

    def finalize(self) -> None:
        self.run = None
