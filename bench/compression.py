"""Gradient compression: bytes pushed per step, examples/s and model quality for each codec.

For each codec (none, fp16, bf16, bf16+pull: values pulled as bfloat16 too, int8, topk:0.01), back to
back in one run, two short local clusters through `paramserver run --ps 1 --workers 2 --compression CODEC`:

- the digits model (examples/digits.py, 784-1024-512-10, Adam): held-out accuracy;
- the CTR model (examples/ctr.py on examples/ctr_data.py's synthetic click logs): held-out AUC
  (its embedding table skips topk rules: with topk:0.01 only its dense layers are compressed).

Prints ONE JSON line: by codec, the bytes the workers pushed per step (whole PushPull frames),
examples/s, accuracy / AUC, and each figure's ratio to the uncompressed run.

    python bench/compression.py [--digits-epochs 2] [--ctr-rows 50000] [--codecs none,fp16,...]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODECS = "none,fp16,bf16,bf16+pull,int8,topk:0.01"


def paramserver_run(codec: str, script: str, args: list[str]) -> dict:
    """The closing JSON line of `paramserver run` with `--compression codec`."""
    # "none" explicitly: the default, auto, would measure links (none here: all on loopback)
    compression = ["--compression", codec.removesuffix("+pull")]
    if codec.endswith("+pull"):  # values pulled as bfloat16 too
        compression += ["--pull-as", "bfloat16"]
    argv = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "run", "--ps", "1", "--workers", "2",
            "--progress-every", "0", *compression, str(ROOT / "examples" / script), "--", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{script} with {codec} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def ctr_data(folder: Path, rows: int) -> tuple[str, str]:
    train, test = folder / "train.tsv", folder / "test.tsv"
    for path, count, seed in ((train, rows, 1), (test, max(rows // 5, 1000), 2)):
        subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", str(count),
                        "--vocab", "200000", "--seed", str(seed), "--out", str(path)], check=True)
    return str(train), str(test)


def figures(summary: dict, quality: str) -> dict:
    return {"pushed_bytes_per_step": summary["pushed_bytes_per_step"], "examples_per_s": summary["examples_per_s"],
            quality: summary.get(quality)}


def ratios(results: dict, key: str) -> dict:
    """Each codec's figure over the uncompressed run's (for bytes: how many times smaller)."""
    base = results.get("none", {}).get(key)
    if not base:
        return {}
    if key == "pushed_bytes_per_step":
        return {codec: round(base / run[key], 2) for codec, run in results.items() if run[key]}
    return {codec: round(run[key] / base, 3) for codec, run in results.items() if run.get(key) is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=CODECS, help=f"comma-separated (default {CODECS})")
    parser.add_argument("--digits-epochs", type=int, default=2)
    parser.add_argument("--ctr-rows", type=int, default=50_000, help="synthetic training rows (test: a fifth)")
    parser.add_argument("--ctr-batch-size", type=int, default=256)
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    digits, ctr = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        train, test = ctr_data(Path(folder), args.ctr_rows)
        for codec in codecs:
            digits[codec] = figures(paramserver_run(codec, "digits.py", ["--epochs", str(args.digits_epochs)]),
                                    "test_accuracy")
            ctr[codec] = figures(paramserver_run(codec, "ctr.py", [
                "--train", train, "--test", test, "--batch-size", str(args.ctr_batch_size),
                "--table-rows", str(args.ctr_rows * 4)]), "test_auc")
    print(json.dumps({"bench": "compression", "ps": 1, "workers": 2, "digits_epochs": args.digits_epochs,
                      "ctr_rows": args.ctr_rows, "digits": digits, "ctr": ctr,
                      "digits_bytes_smaller": ratios(digits, "pushed_bytes_per_step"),
                      "digits_examples_per_s_ratio": ratios(digits, "examples_per_s"),
                      "ctr_bytes_smaller": ratios(ctr, "pushed_bytes_per_step"),
                      "ctr_examples_per_s_ratio": ratios(ctr, "examples_per_s")}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
