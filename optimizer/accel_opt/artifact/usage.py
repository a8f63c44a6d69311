"""How to run a folder, written into its signoff.md: the command and a short Python snippet that loads it (verified,
refused unless signed off) and runs it on inputs of the deployed shapes."""

from __future__ import annotations

from accel_opt.artifact.config import ResourceConfig


def usage_markdown(folder_name: str, config: ResourceConfig) -> list[str]:
    """The lines of the `## Run it` section for the folder `folder_name`."""
    takes = ("text files (a text per line, .jsonl, .parquet, .csv)" if config.text is not None else
             "images" if config.preprocessing is not None else ".npz feed dicts")
    if config.text is not None:
        feed = ['feed, _, _ = deployment.text_encoder.encode(["A sentence to answer."])[0]  # token ids, as the build '
                'did']
    else:
        arrays = ", ".join(f'"{i.name}": np.zeros({tuple(i.shape_used)}, np.{i.dtype})' for i in config.inputs)
        feed = [f"feed = {{{arrays}}}  # the inputs as deployed: preprocessed, batch {config.batch_size}"]
    outputs = ", ".join(f'"{o.name}"' for o in config.outputs)
    return [
        "", "## Run it", "",
        f"On {takes}, one JSON line per input:", "",
        "```",
        f"accel-opt run {folder_name} INPUTS... --out predictions.jsonl",
        "```", "",
        "From Python (the folder is verified first, and refused unless its build signed it off):", "",
        "```python",
        "import numpy as np",
        "from accel_opt import runtime",
        "",
        f'deployment = runtime.load("{folder_name}")',
        *feed,
        "with deployment.runner() as runner:",
        f"    outputs = runner.infer(feed)  # {{{outputs}: arrays}}",
        "```",
    ]
