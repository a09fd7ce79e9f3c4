"""Worker for tests/tools/test_convert_smollm2.py (one process: converting initializes torch.distributed).

    python tests/workers/convert_smollm2_check.py GGUF OUT_DIR DATA_PREFIX

* converts GGUF into OUT_DIR/ok (and OUT_DIR/bad without undoing llama.cpp's Q/K permutation);
* loads each back through megatron_mtraining.training.load_checkpoint and writes the logits of OUT_DIR/ids.npy
  to OUT_DIR/logits_{ok,bad}.npy;
* writes OUT_DIR/argv.json: the pretrain_gpt.py command line (the converter's flags + 2 tiny
  training iterations on DATA_PREFIX) and OUT_DIR/expected.json: the loss of iteration 1 of that run
  (samples 0..1 of its GPTDataset scored by the converted model before any update).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
warnings.filterwarnings("ignore")

import convert_smollm2 as cs  # noqa: E402


def main(gguf: str, out: str, data_prefix: str) -> None:
    import torch
    import torch.nn.functional as F

    from megatron_mtraining import training
    from megatron_mtraining.megatron.args import parse_args

    out_p = Path(out)
    ids = torch.from_numpy(np.load(out_p / "ids.npy")).long()
    for name, unpermute in (("ok", True), ("bad", False)):
        cs.convert(gguf, out_p / name, unpermute_qk=unpermute)
        model, _ = cs.load_converted(out_p / name, ids.shape[1])
        np.save(out_p / f"logits_{name}.npy", cs.logits_of(model, ids).numpy())

    flags = json.loads((out_p / "ok" / "model_args.json").read_text())["pretrain_gpt_flags"]
    argv = flags + ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
                    "--train-iters", "2", "--lr", "1e-4", "--data-path", data_prefix, "--split", "100,0,0",
                    "--eval-iters", "0", "--log-interval", "1", "--seed", "3",
                    "--data-cache-path", str(out_p / "cache")]
    (out_p / "argv.json").write_text(json.dumps(argv))
    args = parse_args(argv)
    tok = training.build_tokenizer(args)
    train, _ = training.build_datasets(args, tok)
    model, _ = cs.load_converted(out_p / "ok", 64)
    total, count = 0.0, 0.0
    for i in range(2):  # iteration 1 = samples 0 and 1 (one micro-batch of 2 at DP=1)
        s = train[i]
        logits = cs.logits_of(model, torch.as_tensor(s["tokens"]).long().unsqueeze(0))[0]
        ce = F.cross_entropy(logits, torch.as_tensor(s["labels"]).long(), reduction="none")
        mask = torch.as_tensor(s["loss_mask"]).float()
        total, count = total + (ce * mask).sum().item(), count + mask.sum().item()
    (out_p / "expected.json").write_text(json.dumps({"iteration1_loss": total / count, "tokens": count}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
