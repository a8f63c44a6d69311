"""The whole text job: embedding a corpus with all-MiniLM-L6-v2, a naive script against sentence-transformers and
`accel-opt run`.

The corpus is generated offline from examples/sentences.txt with the length distribution of real corpora: most
texts a sentence or two, a long tail of paragraphs (some past the 256-token limit). Each side runs as a whole
process from start to exit (imports, model loading, reading, tokenizing, inference, writing the vectors), interleaved
over `--rounds` rounds, on all CPUs:
- naive: tokenize each batch of 32 padded to max_length (256), the fp32 ONNX model on ONNX Runtime, in input order;
- sentence-transformers: `SentenceTransformer.encode` (PyTorch fp32; it sorts the texts by length itself);
- `accel-opt run` of signed-off builds (`--recipe text-encoder`): ONNX Runtime fp32 and OpenVINO fp32, plus OpenVINO
  int8 built with --no-fallback (it does not sign off: timed for its speed, judged by its agreement).
Every side's embeddings are compared with sentence-transformers' (the fp32 reference): cosine per text and
nearest-neighbour agreement over the distinct texts. A GEMM probe before and after shows the host's state."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from accel_opt.accuracy.metrics import nearest_neighbours
from accel_opt.machine.cpu import available_cpus, cpu_info
from benchmarks._common import wait_for_idle
from benchmarks.e2e_job import gemm_probe_gflops

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ROOT / "examples" / "sentences.txt"
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
NAIVE_BATCH = 32  # what scripts (and sentence-transformers' encode) use by default

NAIVE_JOB = """
import sys, numpy as np, onnxruntime as ort
from tokenizers import Tokenizer
model, tokenizer, corpus, out, threads, batch, length = sys.argv[1:8]
tok = Tokenizer.from_file(tokenizer)
tok.enable_truncation(int(length))
tok.enable_padding(length=int(length), pad_id=0)
options = ort.SessionOptions()
options.intra_op_num_threads = int(threads)
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
names = [i.name for i in session.get_inputs()]
texts = open(corpus, encoding="utf-8").read().splitlines()
vectors = []
for start in range(0, len(texts), int(batch)):
    enc = tok.encode_batch(texts[start:start + int(batch)])
    feed = {"input_ids": np.array([e.ids for e in enc], np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}
    vectors.append(session.run(None, {n: feed[n] for n in names})[0])
np.save(out, np.concatenate(vectors))
"""

ST_JOB = """
import os, sys, numpy as np
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, sys.argv[4])
from examples.minilm import model_dir
from sentence_transformers import SentenceTransformer
from transformers.utils import logging
logging.disable_progress_bar()
corpus, out, batch = sys.argv[1:4]
model = SentenceTransformer(str(model_dir()), device="cpu")
texts = open(corpus, encoding="utf-8").read().splitlines()
np.save(out, model.encode(texts, batch_size=int(batch), normalize_embeddings=True))
"""


def make_corpus(path: Path, count: int, seed: int) -> list[str]:
    """`count` texts: 60% one sentence, 25% two or three, 10% four to eight, 5% paragraphs of 10-30 sentences;
    each sentence with a word dropped half of the time, so few texts repeat."""
    sentences = [s for s in SENTENCES.read_text(encoding="utf-8").splitlines() if s.strip()]
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        kind = rng.random()
        k = 1 if kind < 0.6 else int(rng.integers(2, 4)) if kind < 0.85 else int(rng.integers(4, 9)) if kind < 0.95 \
            else int(rng.integers(10, 31))
        parts = []
        for index in rng.integers(0, len(sentences), k):
            words = sentences[index].split()
            if rng.random() < 0.5 and len(words) > 3:
                del words[int(rng.integers(0, len(words)))]
            parts.append(" ".join(words))
        texts.append(" ".join(parts))
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return texts


def run(cmd: list[str], ok=(0,)) -> tuple[float, str]:
    wait_for_idle()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - start
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd[:5])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def build(label: str, work: Path, calibration: Path, threads: int, *flags: str) -> tuple[str, float]:
    accel_opt = str(Path(sys.executable).parent / "accel-opt")
    seconds, out = run([accel_opt, "build", "examples/minilm.py:minilm", "--recipe", "text-encoder", "--data",
                        str(calibration),
                        "--out", str(work / "artifacts"), "--threads", str(threads), "--json", *flags], ok=(0, 1))
    result = json.loads(out)
    print(f"build {label}: {result['backend']} {result['precision']}, signed off: {result['signed_off']}, "
          f"{seconds:.0f} s -> {result['artifact_dir']}", flush=True)
    return result["artifact_dir"], seconds


def agreement(vectors: np.ndarray, reference: np.ndarray, texts: list[str]) -> tuple[float, float, float]:
    """(mean cosine, worst cosine, nearest-neighbour agreement over the distinct texts) against the reference."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    ref = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    cosine = (unit * ref).sum(axis=1)
    first = sorted({text: i for i, text in reversed(list(enumerate(texts)))}.values())
    same = nearest_neighbours(unit[first]) == nearest_neighbours(ref[first])
    return float(cosine.mean()), float(cosine.min()), float(same.mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="texts in the corpus")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds; each side's fastest round is reported")
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--workdir", type=Path, help="keep files here (default: a temp dir)")
    parser.add_argument("--no-int8", action="store_true", help="skip the OpenVINO int8 build")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="accel-opt-text-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    corpus, calibration = work / "corpus.txt", work / "calibration.txt"
    texts = make_corpus(corpus, args.count, seed=1)
    make_corpus(calibration, 96, seed=2)  # the builds' calibration and gate texts: not the job's

    builds = {"ORT fp32": build("ORT fp32", work, calibration, args.threads, "--backend", "onnxruntime",
                                "--precision", "fp32"),
              "OpenVINO fp32": build("OpenVINO fp32", work, calibration, args.threads, "--backend", "openvino",
                                     "--precision", "fp32")}
    if not args.no_int8:
        builds["OpenVINO int8 (not signed off)"] = build("OpenVINO int8", work, calibration, args.threads, "--backend",
                                                         "openvino", "--precision", "int8", "--no-fallback")
    fp32_model = str(Path(builds["ORT fp32"][0]) / "model.onnx")
    tokenizer = str(Path(builds["ORT fp32"][0]) / "tokenizer.json")
    accel_opt = str(Path(sys.executable).parent / "accel-opt")
    sides = {
        "naive (ORT fp32, batch 32 padded to 256)": lambda out: [sys.executable, "-c", NAIVE_JOB, fp32_model, tokenizer,
                                                                  str(corpus), str(out), str(args.threads),
                                                                  str(NAIVE_BATCH), str(MAX_LENGTH)],
        "sentence-transformers encode (torch fp32)": lambda out: [sys.executable, "-c", ST_JOB, str(corpus), str(out),
                                                                   str(NAIVE_BATCH), str(ROOT)],
        **{f"accel-opt run ({label})": (lambda out, folder=folder: [accel_opt, "run", folder, str(corpus), "--out",
                                                                    str(out.with_suffix(".jsonl")),
                                                                    "--overwrite", "--json"])
           for label, (folder, _) in builds.items()},
    }
    files = {name: work / f"side{i}.npy" for i, name in enumerate(sides)}
    probe_before = gemm_probe_gflops(args.threads)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    summaries: dict[str, dict] = {}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in order:
            took, stdout = run(sides[name](files[name]), ok=(0, 3))
            seconds[name].append(took)
            if name.startswith("accel-opt"):
                summaries[name] = json.loads(stdout)
    probe_after = gemm_probe_gflops(args.threads)

    def vectors(name: str) -> np.ndarray:
        out = files[name]  # accel-opt run writes OUT.jsonl and its vectors in OUT.embeddings.npy
        return np.load(out.with_name(out.stem + ".embeddings.npy") if name.startswith("accel-opt") else out)

    st_name = "sentence-transformers encode (torch fp32)"
    naive_name = next(iter(sides))
    reference = vectors(st_name)
    best = {name: min(times) for name, times in seconds.items()}
    cpu = cpu_info()
    tokens = [len(t.split()) for t in texts]
    print(f"host: {cpu['model']}, {cpu['available_cpus']} CPUs, flags {' '.join(cpu['flags'])}")
    print(f"corpus: {len(texts)} texts, {len(set(texts))} distinct; words per text: median {int(np.median(tokens))}, "
          f"p90 {int(np.percentile(tokens, 90))}, max {max(tokens)}")
    print(f"each side a whole process, fastest of {args.rounds} interleaved rounds, {args.threads} threads")
    print()
    print(f"{'job':48} {'seconds':>8} {'texts/s':>8} {'vs naive':>9} {'vs s-t':>7} {'mean cos':>9} {'worst cos':>9} "
          f"{'NN agree':>9}")
    for name in sides:
        mean_cos, worst_cos, nn = agreement(vectors(name), reference, texts)
        print(f"{name:48} {best[name]:8.2f} {len(texts) / best[name]:8.1f} {best[naive_name] / best[name]:8.2f}x "
              f"{best[st_name] / best[name]:6.2f}x {mean_cos:9.6f} {worst_cos:9.6f} {nn:9.1%}")
    print()
    for name, summary in summaries.items():
        stages, text = summary["stages_seconds"], summary["text"]
        total = summary["seconds"]
        print(f"{name}: tokenizing {stages['tokenize']:.2f} s = {stages['tokenize'] / total:.1%} of the job "
              f"({total:.2f} s in-process), compute {stages['compute'] / total:.0%}, reading {stages['read']:.2f} s; "
              f"padding {text['padding_fraction']:.1%} of computed tokens, {text['padding_saved_fraction']:.1%} of "
              f"pad-to-{MAX_LENGTH} tokens saved; {text['truncated']} texts truncated")
    print("builds (not part of the jobs): " + ", ".join(f"{k} {v[1]:.0f} s" for k, v in builds.items()))
    print(f"host state: fp32 GEMM probe {probe_before:.0f} GFLOP/s before the jobs, {probe_after:.0f} after")
    fastest_fp32 = min((n for n in sides if n.startswith("accel-opt") and "int8" not in n), key=best.get)
    print(f"  [{'met' if best[fastest_fp32] < best[naive_name] else 'NOT MET'}] accel-opt run beats the naive job: "
          f"{best[naive_name] / best[fastest_fp32]:.2f}x ({fastest_fp32})")
    print(f"  [{'met' if best[fastest_fp32] <= best[st_name] else 'NOT MET'}] at least level with "
          "sentence-transformers: "
          f"{best[st_name] / best[fastest_fp32]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
