"""Accuracy gate: every sample and every output of a candidate against the fp32 reference.

The reference runs sample by sample; the candidate runs as deployed: batches of the deployed batch
size, cut back into samples (data.output_batch_axis). Each output is judged at its own scale (see
recipe.Tolerance, the one definition of "within tolerance"): over all samples together (scaled
error, cosine, gain, and Polygraphy's absolute statistics) and within each sample (scaled error,
cosine), so one broken sample among many fails and is named. Task metrics (top-k agreement,
embedding cosine, detection precision/recall) are computed here because Polygraphy has none.
"""


from accel_opt.accuracy.judge import judge
from accel_opt.accuracy.models import (
    AccuracyReport,
    Check,
    Evaluation,
    OutputAccuracy,
    SampleAccuracy,
    SteeringVerdict,
    TaskMetricResult,
)
from accel_opt.accuracy.run import compare, fp32_noise_floor, run_candidate

__all__ = ["AccuracyReport", "Check", "Evaluation", "OutputAccuracy", "SampleAccuracy", "SteeringVerdict",
           "TaskMetricResult", "compare",
           "fp32_noise_floor", "judge", "run_candidate"]
