"""OpenVINO on x86 CPUs: the backend, its compile options (compile), saved blobs (blob) and its runner (runner)."""
