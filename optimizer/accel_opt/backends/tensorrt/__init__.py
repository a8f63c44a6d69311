"""Native TensorRT: the backend, engine builds in a child process (build, build_config), the engine inspector's
per-layer precision (inspector) and the plan's profiles and compatibility (plan). `tensorrt` is imported only inside
the functions that build or run an engine, on a machine with a CUDA device."""
