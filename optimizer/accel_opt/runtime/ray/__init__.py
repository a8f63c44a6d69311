"""The Ray Data engine of `accel-opt run --engine ray`: the actor that answers with the local engine's functions
(predictor), the driver's job (job) and the cluster session (cluster)."""
