"""Inputs before the model: image preprocessing checked against the model it feeds, and fused into its graph.

- `fit`: a recipe's crop and resize fitted to the image input's fixed size, and the staged artifact exercised on
  generated images through `accel-opt run`'s own job before it is published.
- `fuse`: normalize and layout as ONNX ops at the front of the model, so the artifact takes uint8 crops.
"""
