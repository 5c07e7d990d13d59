#!/usr/bin/env python
"""A DeepSeek-V3 (no indexer) HF fixture for `init_from` a V3.1-Terminus-style checkpoint: tests/fixtures/deepseek_v3_short.

Takes the V3.2 fixture tests/fixtures/hf_short (tools/make_hf_golden.py; seq 20 < index_topk 32, so its V3.2
model attends densely), drops every `self_attn.indexer.*` tensor and the index_* config fields, writes it as an
HF `deepseek_v3` checkpoint (model_type deepseek_v3, DeepseekV3ForCausalLM), then runs Hugging Face transformers'
`DeepseekV3ForCausalLM` (fp32, eager) on it and stores its logits for the fixture's tokens in golden.npz. It checks
that they equal the V3.2 fixture's dense logits (same weights, dense attention) to 1e-5 relative.

    pip install torch==2.13.0 transformers safetensors numpy      # (a separate venv; torch is not a test dep)
    python tools/make_hf_v3_fixture.py [--src tests/fixtures/hf_short] [--out tests/fixtures/deepseek_v3_short]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np


def main(argv=None):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default=os.path.join(here, "tests", "fixtures", "hf_short"))
    p.add_argument("--out", default=os.path.join(here, "tests", "fixtures", "deepseek_v3_short"))
    a = p.parse_args(argv)

    import torch
    import transformers
    from safetensors.numpy import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    for key in [k for k in cfg if k.startswith("index_")]:
        del cfg[key]
    cfg["model_type"] = "deepseek_v3"
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    weights = load_file(os.path.join(a.src, "model.safetensors"))
    kept = {k: v for k, v in weights.items() if ".self_attn.indexer." not in k}
    dropped = len(weights) - len(kept)
    golden = np.load(os.path.join(a.src, "golden.npz"))
    tokens = golden["tokens"]

    tmp = tempfile.mkdtemp(prefix="hf_v3_", dir=os.path.dirname(os.path.abspath(a.out)))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        save_file(kept, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
        ref = golden["dense_logits"]
        err = float(np.abs(logits - ref).max() / np.abs(ref).max())
        if err > 1e-5:
            raise SystemExit(f"DeepseekV3ForCausalLM logits differ from the V3.2 fixture's dense logits: {err:.3g}")
        np.savez(os.path.join(tmp, "golden.npz"), tokens=tokens, logits=logits.astype(np.float32))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"source": os.path.basename(a.src), "dropped_indexer_tensors": dropped,
                       "transformers": transformers.__version__, "torch": torch.__version__,
                       "rel_err_vs_v32_dense_logits": err}, f, indent=2)
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        shutil.rmtree(a.out, ignore_errors=True)
        os.replace(tmp, a.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {a.out}: {len(kept)} tensors ({dropped} indexer tensors dropped), logits vs V3.2 dense {err:.2e}")


if __name__ == "__main__":
    main()
