"""`accel_opt.runtime.distributed`, the documented import path of the Ray Data predictor (docs/distributed.md): the
engine itself lives in accel_opt.runtime.ray.predictor."""

from accel_opt.runtime.ray.predictor import Predictor, predict

__all__ = ["Predictor", "predict"]
