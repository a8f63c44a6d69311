"""The local engine of `accel-opt run`: the job (job), its device-resident image path for torch artifacts (device) and
its text path (text)."""
