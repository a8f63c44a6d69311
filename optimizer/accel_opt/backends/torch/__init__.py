"""PyTorch: factories and the export to ONNX (backend, export), the module precision transforms (modules), torch
runners (runner) and the torch.export + AOTInductor deployment backend (package). torch itself is imported lazily."""
