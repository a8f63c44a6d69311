"""Reports, data first: the JSON models a build returns and writes, and what is rendered from them only.

- `results`: `BuildResult` and its parts (stages, headline numbers, what the verdict rests on).
- `markdown`: `signoff.md`, `benchmark.md`, the selection report.
- `html`: `signoff.html` with its embedded plots (latency/throughput, layer error).
"""
