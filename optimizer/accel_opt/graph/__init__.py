"""The ONNX graph a build starts from: loaded safely, exported from PyTorch, cleaned up, inspected and saved.

- `load`: file checks, external data kept inside the model's folder, checker, shape inference, unknown domains.
- `export`: a PyTorch factory exported to ONNX and verified against PyTorch.
- `lift`: old opsets ONNX Runtime has no kernels for, converted.
- `cleanup`: constant folding and simplification, kept only when it matches the original.
- `inspect`: inputs, outputs, ops, parameters, FLOPs, batch axes.
- `save`: writing a model, with external data above a size.
"""
