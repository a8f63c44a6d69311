"""This machine: what it is and what it can run.

- `cpu`: CPU facts read once (flags, model, CPUs available) and the CPU class whose kernels a sign-off holds for.
- `cpu_speed`: which precisions are faster than fp32 here, measured on a small model and cached per CPU.
- `gpu`: NVIDIA GPUs found without loading CUDA into the process (libcuda through ctypes, nvidia-smi).
- `doctor`: `accel-opt doctor`'s report, from the three above and the installed backends.
"""
