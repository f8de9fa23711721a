"""ONNX Runtime runner inputs of integer types are fed as their own type, and one it cannot bind by pointer
is refused by name instead of being read as float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _cast_model(path, elem_type):
    """y = float(x) * 2 for an input x of the given ONNX element type, shape [N, 4]."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", elem_type, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
                               helper.make_node("Mul", ["xf", "two"], ["y"])], "cast", [x], [y], [two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def test_a_uint8_input_is_fed_as_uint8(tmp_path):
    from onnx import TensorProto

    from torchspeed.infer.runners import OrtRunner

    runner = OrtRunner(_cast_model(tmp_path / "u8.onnx", TensorProto.UINT8), providers="cpu")
    x = np.array([[0, 1, 200, 255]] * 3, dtype=np.uint8)
    out = runner(torch.from_numpy(x))
    assert out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), x.astype(np.float32) * 2)


def test_a_type_it_cannot_bind_is_refused_by_name(tmp_path):
    from onnx import TensorProto

    from torchspeed.infer.runners import OrtRunner

    runner = OrtRunner(_cast_model(tmp_path / "u16.onnx", TensorProto.UINT16), providers="cpu")
    x = np.array([[1, 2, 3, 60000]], dtype=np.uint16)
    np.testing.assert_array_equal(runner(x).numpy(), x.astype(np.float32) * 2)  # fed as given on the CPU
    with pytest.raises(ValueError, match=r"input 'x' has type tensor\(uint16\).*cannot bind"):
        runner.run_bound({"x": torch.from_numpy(x.astype(np.int32))})
