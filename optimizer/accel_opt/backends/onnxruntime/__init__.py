"""ONNX Runtime: the CPU EP (backend), the CUDA and TensorRT EPs (gpu) and I/O binding for device timing (iobinding)."""
