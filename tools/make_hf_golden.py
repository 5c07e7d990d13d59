#!/usr/bin/env python
"""Generate small HF-transformers golden fixtures for DeepSeek-V3.2 (DSA) parity tests.

Runs Hugging Face transformers' ``DeepseekV32ForCausalLM`` (fp32, eager attention, eager experts)
on tiny random configs and writes, per case, ``tests/fixtures/hf_<case>/``:

* ``config.json``        -- written by ``DeepseekV32Config.save_pretrained`` (HF field names).
* ``model.safetensors``  -- official hub on-disk layout (per-expert ``experts.{e}.{gate,up,down}_proj``
                            tensors, all PyTorch ``[out, in]``), metadata ``{"format": "pt"}``.
* ``golden.npz``         -- ``tokens`` int32 [B,S]; ``logits`` f32 [B,S,V]; ``dense_logits`` f32
                            [B,S,V] (same weights, indexer top-k forced >= S so DSA is dense);
                            ``topk_l{i}`` int32 [B,S,k'] (see below); ``sel_l{i}`` bool [B,S,S]
                            (selected AND causally visible keys); ``hidden_l{i}`` f32 [B,S,H] (output
                            of decoder layer i, before the final norm); ``inv_freq`` f32 (HF YaRN
                            inverse frequencies of the rope dims).
* ``meta.json``          -- versions, seed, description, check statistics.
* ``generate.json``      -- (cases long, moe_bias) HF greedy ``generate`` with and without its decode cache
                            (see ``record_generate``); ``--generate_only`` rewrites just these.

``topk_l{i}``: k' = min(index_topk, S) as HF uses. Each row holds the *causally visible* selected key
positions sorted ascending, followed by ``-1`` padding. (For query s with s+1 <= k' visible keys HF's
``topk`` also returns arbitrary masked future positions; they never take part in attention and are
replaced by -1 here, so the array is unambiguous.)

Every fixture is cross-checked before it is written:
  * an independent float64 numpy re-implementation (reading the *written* hub-layout safetensors
    file) must reproduce HF's logits (rel. err <= 2e-5) and HF's indexer selections exactly;
  * tie safety: for every layer / batch / query row with more than k visible keys the gap between the
    k-th and (k+1)-th largest visible index score must exceed ``--gap`` (default 1e-3) times the row's
    max |score|; the same is required of the MoE router (group choice and expert choice, relative to
    the max |biased score|).  Otherwise the next seed is tried and the seed used is recorded;
  * ``from_pretrained(out_dir)`` must reproduce the in-memory logits bit-exactly;
  * ``short``: logits == dense_logits exactly; other cases: max|logits - dense_logits| > 1e-2 max|logits|;
  * common porting mistakes (wrong rope layouts, router bias misuse, no group limit, ...) are
    evaluated with the numpy reference and must move the logits by > 1e-3 max|logit|
    (recorded in meta.json under "discrimination").

Requirements (the project's ``hf`` extra provides them)::

    pip install torch==2.13.0 transformers safetensors numpy

(generated with torch 2.13.0+cpu, transformers 5.23.0).  Usage::

    python tools/make_hf_golden.py --out tests/fixtures [--cases short long moe_bias] [--seed 0] [--generate_only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

CASES = {
    "short": dict(
        description="seq_len (20) < index_topk (32): DSA selection keeps every key, i.e. exactly dense "
        "attention. 3 layers (1 dense MLP + 2 MoE), 8 experts / 4 groups, YaRN factor 40 with "
        "original_max_position_embeddings 4096.",
        seq_len=20,
        batch=2,
        config=dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            index_n_heads=8, index_head_dim=32, index_topk=32, vocab_size=256, rms_norm_eps=1e-6,
            original_max_position_embeddings=4096, rope_factor=40.0,
        ),
        bias_std=0.1,
    ),
    "long": dict(
        description="seq_len (40) = 5 x index_topk (8): DSA top-k selection active. 3 layers (1 dense MLP + "
        "2 MoE), 8 experts / 4 groups, YaRN factor 40 with original_max_position_embeddings 4096.",
        seq_len=40,
        batch=2,
        config=dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            index_n_heads=8, index_head_dim=32, index_topk=8, vocab_size=256, rms_norm_eps=1e-6,
            original_max_position_embeddings=4096, rope_factor=40.0,
        ),
        bias_std=0.1,
    ),
    "moe_bias": dict(
        description="MoE with 16 experts in 4 groups (topk_group 2, 4 experts/token, 2 shared experts) and a "
        "large non-zero e_score_correction_bias; DSA selection active (seq 24, index_topk 8). Different "
        "head dims (qk_nope 12, qk_rope 16, v 20) and YaRN original_max_position_embeddings 64 (fractional "
        "YaRN ramp).",
        seq_len=24,
        batch=2,
        config=dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=12, qk_rope_head_dim=16, v_head_dim=20, intermediate_size=96,
            moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            index_n_heads=8, index_head_dim=32, index_topk=8, vocab_size=256, rms_norm_eps=1e-6,
            original_max_position_embeddings=64, rope_factor=40.0,
        ),
        bias_std=0.3,
    ),
}

DENSE_TOPK = 1 << 30
MAX_SEED_TRIES = 2000


# ----------------------------------------------------------------------------------------------------
# HF model construction
# ----------------------------------------------------------------------------------------------------
def build_config(c):
    from transformers import DeepseekV32Config

    c = dict(c)
    orig = c.pop("original_max_position_embeddings")
    factor = c.pop("rope_factor")
    return DeepseekV32Config(
        **c,
        num_key_value_heads=c["num_attention_heads"],
        max_position_embeddings=int(orig * factor),
        rope_parameters=dict(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=orig,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=10000.0,
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
    )


def randomize_(model, gen, bias_std):
    """Give every parameter / persistent buffer a distinctive random value (in place)."""

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(torch.float32)

    gains = {
        "q_b_proj": 1.5,  # attention logits with O(1) spread (not near-uniform softmax)
        "kv_b_proj": 1.5,
        "mlp.gate": 2.0,  # router logits spread over the sigmoid
        "indexer.wq_b": 1.5,
        "indexer.weights_proj": 1.5,
        "lm_head": 2.0,
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * randn(p.shape))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.1 * randn(p.shape))
            elif name == "model.embed_tokens.weight":
                p.copy_(randn(p.shape))
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                fan_in = p.shape[-1]
                p.copy_(randn(p.shape) / math.sqrt(fan_in))
            elif p.dim() == 2:
                fan_in = p.shape[1]
                g = 1.0
                for key, val in gains.items():
                    if key in name:
                        g = val
                p.copy_(g * randn(p.shape) / math.sqrt(fan_in))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * randn(b.shape))


def make_model(cfg):
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM._from_config(
        cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    return model


def run_hf(model, tokens, capture=True):
    """Forward pass; returns logits, per-layer raw top-k indices, per-layer decoder outputs."""
    topk, hidden, handles = {}, {}, []
    if capture:
        for i, layer in enumerate(model.model.layers):
            handles.append(
                layer.self_attn.indexer.register_forward_hook(
                    lambda m, a, o, i=i: topk.__setitem__(i, o.detach().clone())
                )
            )
            handles.append(
                layer.register_forward_hook(
                    lambda m, a, o, i=i: hidden.__setitem__(i, (o[0] if isinstance(o, tuple) else o).detach().clone())
                )
            )
    try:
        with torch.no_grad():
            out = model(input_ids=tokens, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out.logits.detach().clone(), topk, hidden


def set_index_topk(model, k):
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = k


# ----------------------------------------------------------------------------------------------------
# Independent float64 numpy reference (reads the hub-layout safetensors file)
# ----------------------------------------------------------------------------------------------------
def np_rmsnorm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def np_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_yarn(cfgd):
    rp = cfgd["rope_parameters"]
    dim = cfgd["qk_rope_head_dim"]
    base, factor = rp["rope_theta"], rp["factor"]
    orig = rp["original_max_position_embeddings"]

    def corr_dim(n_rot):
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rp["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rp["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = freq / factor * ramp + freq * (1.0 - ramp)

    def ms(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    cos_sin_factor = ms(factor, rp["mscale"]) / ms(factor, rp["mscale_all_dim"])
    softmax_mscale = ms(factor, rp["mscale_all_dim"]) ** 2
    return inv_freq, cos_sin_factor, softmax_mscale


def rope_pairs_interleaved(x, cos, sin):
    """Rotate consecutive pairs (x[2j], x[2j+1]) by angle j; output keeps the interleaved layout."""
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def rope_pairs_half(x, cos, sin):
    """Rotate pairs (x[j], x[j + d/2]) by angle j (GPT-NeoX / rotate_half layout)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def np_forward(W, cfgd, tokens, variant=(), dense=False):
    """float64 forward of one batch. Returns logits [B,S,V] and diagnostics per layer.

    ``variant`` names deliberate mistakes (for the discrimination check only).
    """
    v = set(variant)
    H = cfgd["num_attention_heads"]
    nope, rope, vd = cfgd["qk_nope_head_dim"], cfgd["qk_rope_head_dim"], cfgd["v_head_dim"]
    kvr = cfgd["kv_lora_rank"]
    nih, ihd, itopk = cfgd["index_n_heads"], cfgd["index_head_dim"], cfgd["index_topk"]
    E, G, TG, K = cfgd["n_routed_experts"], cfgd["n_group"], cfgd["topk_group"], cfgd["num_experts_per_tok"]
    eps = cfgd["rms_norm_eps"]
    inv_freq, cs_factor, sm_mscale = np_yarn(cfgd)
    if "no_yarn" in v:
        inv_freq = 1.0 / cfgd["rope_parameters"]["rope_theta"] ** (np.arange(0, rope, 2) / rope)
    if "no_mscale" in v:
        sm_mscale = 1.0
    scale = (nope + rope) ** -0.5 * sm_mscale
    B, S = tokens.shape
    ang = np.arange(S, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang) * cs_factor, np.sin(ang) * cs_factor
    causal = np.tril(np.ones((S, S), dtype=bool))
    lin = lambda x, name: x @ W[name].T  # noqa: E731
    silu = lambda x: x / (1.0 + np.exp(-x))  # noqa: E731

    h = W["model.embed_tokens.weight"][tokens]  # [B,S,D]
    diag = []
    for layer in range(cfgd["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        ix = a + "indexer."
        x = np_rmsnorm(h, W[p + "input_layernorm.weight"], eps)
        # ---- MLA
        q_resid = np_rmsnorm(lin(x, a + "q_a_proj.weight"), W[a + "q_a_layernorm.weight"], 1e-6)
        q = lin(q_resid, a + "q_b_proj.weight").reshape(B, S, H, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = lin(x, a + "kv_a_proj_with_mqa.weight")
        c, k_pe = kv[..., :kvr], kv[..., kvr:]
        c = np_rmsnorm(c, W[a + "kv_a_layernorm.weight"], 1e-6)
        kvb = lin(c, a + "kv_b_proj.weight").reshape(B, S, H, nope + vd)
        k_nope, val = kvb[..., :nope], kvb[..., nope:]
        mla_rope = rope_pairs_half if "mla_rope_half" in v else rope_pairs_interleaved
        q_pe = mla_rope(q_pe, cos[None, :, None, :], sin[None, :, None, :])
        k_pe = mla_rope(k_pe, cos[None], sin[None])
        logits_att = (
            np.einsum("bshd,bthd->bhst", q_nope, k_nope) + np.einsum("bshd,btd->bhst", q_pe, k_pe)
        ) * scale
        # ---- indexer
        qi = lin(q_resid, ix + "wq_b.weight").reshape(B, S, nih, ihd)
        ki = np_layernorm(lin(x, ix + "wk.weight"), W[ix + "k_norm.weight"], W[ix + "k_norm.bias"], 1e-6)
        idx_rope = rope_pairs_interleaved if "indexer_rope_interleaved" in v else rope_pairs_half
        cq, sq = cos[None, :, None], sin[None, :, None]
        ck, sk = cos[None], sin[None]
        if "indexer_rope_last" in v:  # rope on the last dims instead of the first
            qi = np.concatenate([qi[..., : ihd - rope], idx_rope(qi[..., ihd - rope :], cq, sq)], -1)
            ki = np.concatenate([ki[..., : ihd - rope], idx_rope(ki[..., ihd - rope :], ck, sk)], -1)
        else:  # HF: rope on the first qk_rope_head_dim dims of each indexer head, rest passes through
            qi = np.concatenate([idx_rope(qi[..., :rope], cq, sq), qi[..., rope:]], -1)
            ki = np.concatenate([idx_rope(ki[..., :rope], ck, sk), ki[..., rope:]], -1)
        sc = np.einsum("bshd,btd->bsht", qi, ki) * ihd**-0.5
        if "indexer_no_relu" not in v:
            sc = np.maximum(sc, 0.0)
        wts = lin(x, ix + "weights_proj.weight") * nih**-0.5
        iscore = np.einsum("bsh,bsht->bst", wts, sc)  # [B,S,T]
        kk = DENSE_TOPK if dense else itopk
        sel = np.zeros((B, S, S), dtype=bool)
        gaps = []
        for b in range(B):
            for s in range(S):
                vis = iscore[b, s, : s + 1]
                if s + 1 <= kk:
                    sel[b, s, : s + 1] = True
                    continue
                order = np.argsort(-vis, kind="stable")
                sel[b, s, order[:kk]] = True
                srt = vis[order]
                gaps.append((srt[kk - 1] - srt[kk]) / max(np.abs(vis).max(), 1e-30))
        mask = causal[None] & sel  # [B,S,T]
        logits_att = np.where(mask[:, None], logits_att, -np.inf)
        logits_att = logits_att - logits_att.max(-1, keepdims=True)
        pr = np.exp(logits_att)
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("bhst,bthd->bshd", pr, val).reshape(B, S, H * vd)
        h = h + lin(o, a + "o_proj.weight")
        # ---- MLP
        x = np_rmsnorm(h, W[p + "post_attention_layernorm.weight"], eps)
        rgaps = []
        if layer < cfgd["first_k_dense_replace"]:
            m = p + "mlp."
            y = lin(silu(lin(x, m + "gate_proj.weight")) * lin(x, m + "up_proj.weight"), m + "down_proj.weight")
        else:
            m = p + "mlp."
            xt = x.reshape(B * S, -1)
            sig = 1.0 / (1.0 + np.exp(-(xt @ W[m + "gate.weight"].T)))  # [N,E]
            bias = W[m + "gate.e_score_correction_bias"]
            choice = sig if "router_no_bias" in v else sig + bias
            gsc = np.sort(choice.reshape(-1, G, E // G), axis=-1)[..., ::-1][..., :2].sum(-1)  # [N,G]
            y = np.zeros_like(xt)
            for n in range(xt.shape[0]):
                gorder = np.argsort(-gsc[n], kind="stable")
                keep_g = gorder[:TG] if "router_no_group" not in v else gorder
                cm = np.full(E, -np.inf)
                for g in keep_g:
                    cm[g * (E // G) : (g + 1) * (E // G)] = choice[n, g * (E // G) : (g + 1) * (E // G)]
                eorder = np.argsort(-cm, kind="stable")
                experts = eorder[:K]
                sscale = np.abs(choice[n]).max()
                if "router_no_group" not in v:
                    rgaps.append((gsc[n, gorder[TG - 1]] - gsc[n, gorder[TG]]) / sscale)
                rgaps.append((cm[eorder[K - 1]] - cm[eorder[K]]) / sscale)
                gw = (choice if "router_bias_in_weights" in v else sig)[n, experts]
                if "router_no_norm" not in v:
                    gw = gw / (gw.sum() + 1e-20)
                gw = gw * cfgd["routed_scaling_factor"]
                for e, wgt in zip(experts, gw):
                    ep = f"{m}experts.{e}."
                    ye = (silu(xt[n] @ W[ep + "gate_proj.weight"].T) * (xt[n] @ W[ep + "up_proj.weight"].T)) @ W[
                        ep + "down_proj.weight"
                    ].T
                    y[n] += wgt * ye
            sh = m + "shared_experts."
            y_sh = silu(lin(xt, sh + "gate_proj.weight")) * lin(xt, sh + "up_proj.weight")
            y = y + lin(y_sh, sh + "down_proj.weight")
            y = y.reshape(B, S, -1)
        h = h + y
        diag.append(dict(sel=mask, gaps=np.array(gaps), rgaps=np.array(rgaps), hidden=h.copy()))
    h = np_rmsnorm(h, W["model.norm.weight"], eps)
    return h @ W["lm_head.weight"].T, diag


# ----------------------------------------------------------------------------------------------------
# Hub layout
# ----------------------------------------------------------------------------------------------------
def expected_hub_state(model, cfgd):
    """Hub-layout state dict built independently from the module tensors (fused experts split)."""
    I = cfgd["moe_intermediate_size"]
    out = {}
    sd = model.state_dict()
    for name, t in sd.items():
        if "rotary_emb" in name:
            continue
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            assert t.shape == (cfgd["n_routed_experts"], 2 * I, cfgd["hidden_size"]), t.shape
            for e in range(t.shape[0]):
                # HF: F.linear(x, gate_up_proj[e]).chunk(2, -1) -> (gate, up): gate rows first, then up.
                out[f"{base}{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, I:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def expected_hub_keys(cfgd):
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for l in range(cfgd["num_hidden_layers"]):
        p = f"model.layers.{l}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for n in ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                  "o_proj"]:
            keys.add(f"{p}self_attn.{n}.weight")
        for n in ["wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"]:
            keys.add(f"{p}self_attn.indexer.{n}")
        if l < cfgd["first_k_dense_replace"]:
            keys |= {f"{p}mlp.{n}_proj.weight" for n in ["gate", "up", "down"]}
        else:
            keys |= {f"{p}mlp.gate.weight", f"{p}mlp.gate.e_score_correction_bias"}
            keys |= {f"{p}mlp.shared_experts.{n}_proj.weight" for n in ["gate", "up", "down"]}
            for e in range(cfgd["n_routed_experts"]):
                keys |= {f"{p}mlp.experts.{e}.{n}_proj.weight" for n in ["gate", "up", "down"]}
    return keys


def write_checkpoint(model, cfg, cfgd, out_dir):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model.save_pretrained(out_dir, safe_serialization=True)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    path = os.path.join(out_dir, "model.safetensors")
    exp = expected_hub_state(model, cfgd)
    assert set(exp) == expected_hub_keys(cfgd), sorted(set(exp) ^ expected_hub_keys(cfgd))
    ok = os.path.exists(path)
    if ok:
        with safe_open(path, "pt") as f:
            ok = set(f.keys()) == set(exp) and (f.metadata() or {}).get("format") == "pt"
            ok = ok and all(torch.equal(f.get_tensor(k), exp[k]) for k in exp)
    if not ok:
        # save_pretrained did not produce the hub layout (e.g. fused experts): write it ourselves.
        print("  save_pretrained output is not the hub layout -> writing model.safetensors manually")
        for fn in os.listdir(out_dir):
            if fn.endswith(".safetensors") or fn.endswith(".safetensors.index.json"):
                os.remove(os.path.join(out_dir, fn))
        save_file({k: v.contiguous() for k, v in sorted(exp.items())}, path, metadata={"format": "pt"})
        cfg.save_pretrained(out_dir)
    os.chmod(path, 0o644)
    return "save_pretrained" if ok else "manual"


def load_np_weights(path):
    from safetensors.numpy import load_file

    return {k: v.astype(np.float64) for k, v in load_file(path).items()}


# ----------------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------------
def format_topk(raw, S):
    """raw: [B,S,k] int -> visible selected positions ascending, padded with -1; plus [B,S,S] bool mask."""
    raw = raw.numpy().astype(np.int64)
    B, _, k = raw.shape
    out = np.full((B, S, k), -1, dtype=np.int32)
    sel = np.zeros((B, S, S), dtype=bool)
    for b in range(B):
        for s in range(S):
            vis = np.unique(raw[b, s][raw[b, s] <= s])
            assert len(raw[b, s]) == len(np.unique(raw[b, s]))
            assert len(vis) == min(k, s + 1), (b, s, vis, k)
            out[b, s, : len(vis)] = vis
            sel[b, s, vis] = True
    return out, sel


def try_case(name, spec, seed, gap_tol):
    cfg = build_config(spec["config"])
    cfgd = cfg.to_dict()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = make_model(cfg)
    randomize_(model, gen, spec["bias_std"])
    B, S = spec["batch"], spec["seq_len"]
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    assert not torch.equal(tokens[0], tokens[1])

    logits, topk_raw, hidden = run_hf(model, tokens)
    set_index_topk(model, DENSE_TOPK)
    dense_logits, _, _ = run_hf(model, tokens, capture=False)
    set_index_topk(model, cfg.index_topk)

    # numpy float64 reference (weights from the hub-layout state dict, identical to what is written)
    W = {k: v.double().numpy() for k, v in expected_hub_state(model, cfgd).items()}
    ref_logits, diag = np_forward(W, cfgd, tokens.numpy())
    min_gap = min([d["gaps"].min() for d in diag if d["gaps"].size] or [np.inf])
    min_rgap = min([d["rgaps"].min() for d in diag if d["rgaps"].size] or [np.inf])
    if min_gap <= gap_tol or min_rgap <= gap_tol:
        return None, dict(min_gap=float(min_gap), min_rgap=float(min_rgap))

    L = logits.numpy()
    scale = float(np.abs(L).max())
    rel_ref = float(np.abs(ref_logits - L).max() / scale)
    assert rel_ref <= 2e-5, f"{name}: numpy reference disagrees with HF: rel err {rel_ref:.3e}"
    topk_fmt, sels = {}, {}
    for i in range(cfg.num_hidden_layers):
        topk_fmt[i], sels[i] = format_topk(topk_raw[i], S)
        assert np.array_equal(sels[i], diag[i]["sel"]), f"{name}: layer {i} selection differs from numpy reference"
        assert topk_fmt[i].shape[-1] == min(cfg.index_topk, S)
    D = dense_logits.numpy()
    sparse_vs_dense = float(np.abs(L - D).max() / scale)
    if name == "short":
        assert S <= cfg.index_topk and np.array_equal(L, D), "short: logits must equal dense_logits"
    else:
        assert S > cfg.index_topk
        if sparse_vs_dense <= 1e-2:
            return None, dict(min_gap=float(min_gap), min_rgap=float(min_rgap), sparse_vs_dense=sparse_vs_dense)
    ref_dense, _ = np_forward(W, cfgd, tokens.numpy(), dense=True)
    rel_ref_dense = float(np.abs(ref_dense - D).max() / scale)
    assert rel_ref_dense <= 2e-5, f"{name}: numpy dense reference disagrees: {rel_ref_dense:.3e}"

    return dict(
        cfg=cfg, cfgd=cfgd, model=model, tokens=tokens.numpy().astype(np.int32), logits=L, dense_logits=D,
        topk=topk_fmt, sel=sels, hidden={i: hidden[i].numpy() for i in hidden}, W=W,
        stats=dict(
            min_index_gap_rel=float(min_gap), min_router_gap_rel=float(min_rgap), numpy_ref_rel_err=rel_ref,
            numpy_ref_dense_rel_err=rel_ref_dense, sparse_vs_dense_rel=sparse_vs_dense, max_abs_logit=scale,
            max_abs_hidden=float(max(np.abs(h.numpy()).max() for h in hidden.values())),
        ),
    ), None


DISCRIMINATION = {
    "all": ["mla_rope_half", "no_yarn", "no_mscale", "router_no_bias", "router_bias_in_weights", "router_no_norm",
            "router_no_group"],
    "sparse": ["indexer_rope_interleaved", "indexer_rope_last", "indexer_no_relu"],
}


def generate(name, spec, out_root, seed0, gap_tol):
    import transformers

    fails = 0
    for seed in range(seed0, seed0 + MAX_SEED_TRIES):
        res, why = try_case(name, spec, seed, gap_tol)
        if res is not None:
            break
        fails += 1
        print(f"  [{name}] seed {seed} rejected: {why}")
    else:
        raise RuntimeError(f"{name}: no acceptable seed in {MAX_SEED_TRIES} tries")

    cfg, cfgd, model = res["cfg"], res["cfgd"], res["model"]
    out_dir = os.path.join(out_root, f"hf_{name}")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    writer = write_checkpoint(model, cfg, cfgd, out_dir)

    # Reload from disk: config and weights must round-trip bit-exactly.
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg2 = DeepseekV32Config.from_pretrained(out_dir)
    assert cfg2.to_dict() == cfgd or _cfg_equal(cfg2.to_dict(), cfgd)
    m2 = DeepseekV32ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    l2, _, _ = run_hf(m2, torch.from_numpy(res["tokens"]).long(), capture=False)
    assert np.array_equal(l2.numpy(), res["logits"]), f"{name}: reloaded checkpoint gives different logits"
    # And the numpy reference reading the written file itself.
    Wf = load_np_weights(os.path.join(out_dir, "model.safetensors"))
    assert set(Wf) == expected_hub_keys(cfgd)
    ref_file, _ = np_forward(Wf, json.load(open(os.path.join(out_dir, "config.json"))), res["tokens"].astype(np.int64))
    rel_file = float(np.abs(ref_file - res["logits"]).max() / res["stats"]["max_abs_logit"])
    assert rel_file <= 2e-5, rel_file

    # Discrimination: typical porting mistakes must visibly change the logits.
    disc = {}
    variants = DISCRIMINATION["all"] + (DISCRIMINATION["sparse"] if name != "short" else [])
    for var in variants:
        lv, _ = np_forward(Wf, cfgd, res["tokens"].astype(np.int64), variant=(var,))
        disc[var] = float(np.abs(lv - res["logits"]).max() / res["stats"]["max_abs_logit"])
        assert disc[var] > 1e-3, f"{name}: fixture does not detect mistake {var!r} ({disc[var]:.2e})"

    arrays = dict(tokens=res["tokens"], logits=res["logits"].astype(np.float32),
                  dense_logits=res["dense_logits"].astype(np.float32),
                  inv_freq=model.model.rotary_emb.inv_freq.numpy().astype(np.float32))
    for i in range(cfg.num_hidden_layers):
        arrays[f"topk_l{i}"] = res["topk"][i]
        arrays[f"sel_l{i}"] = res["sel"][i]
        arrays[f"hidden_l{i}"] = res["hidden"][i].astype(np.float32)
    np.savez_compressed(os.path.join(out_dir, "golden.npz"), **arrays)

    meta = dict(
        case=name,
        description=spec["description"],
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        numpy_version=np.__version__,
        seed=seed,
        seeds_rejected=fails,
        batch=spec["batch"],
        seq_len=spec["seq_len"],
        index_topk=cfg.index_topk,
        topk_width=min(cfg.index_topk, spec["seq_len"]),
        max_abs_logit=res["stats"]["max_abs_logit"],
        dtype="float32",
        attn_implementation="eager",
        experts_implementation="eager",
        weights_written_by=writer,
        attention_scaling_softmax=float(model.model.layers[0].self_attn.scaling),
        rope_attention_factor=float(model.model.rotary_emb.attention_scaling),
        checks=dict(res["stats"], numpy_ref_from_file_rel_err=rel_file, gap_tolerance=gap_tol),
        discrimination=disc,
        arrays={
            "tokens": "int32 [B,S] input ids (no padding, no attention_mask, positions 0..S-1)",
            "logits": "float32 [B,S,V] HF logits with DSA top-k = index_topk",
            "dense_logits": "float32 [B,S,V] same weights, every indexer's index_topk set to 2**30 (dense)",
            "topk_l{i}": "int32 [B,S,min(index_topk,S)] causally visible selected keys ascending, -1 padded",
            "sel_l{i}": "bool [B,S,S] key t selected by layer i's indexer for query s and t <= s",
            "hidden_l{i}": "float32 [B,S,hidden] output of decoder layer i (residual stream, pre final norm)",
            "inv_freq": "float32 [qk_rope_head_dim/2] HF YaRN inverse frequencies",
        },
    )
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=False)
        f.write("\n")
    if name in GEN_CASES:
        record_generate(out_dir)
    return out_dir, meta


GEN_PROMPT = 16  # prompt tokens (the first 16 of golden.npz's tokens per row): > index_topk (8) of the sparse cases
GEN_NEW = 16  # greedy tokens generated after each prompt
GEN_CASES = ("long", "moe_bias")  # the cases whose top-k selection is active (prompt + generated > index_topk)


def record_generate(out_dir):
    """``generate.json``: HF ``generate`` (greedy, with its decode cache, and again with ``use_cache=False``,
    which re-runs the whole prefix per token: the reference that needs no cache to be right) on the first
    GEN_PROMPT tokens of each row of golden.npz, GEN_NEW new tokens, no EOS stop. Both must agree (else HF's cached
    decode is wrong here and the test compares with the uncached tokens, recorded as ``reference``); the smallest
    top-1 / top-2 logit margin along the greedy path is recorded (a near-tie would make any port's tokens fragile)."""
    import transformers
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    tokens = np.load(os.path.join(out_dir, "golden.npz"))["tokens"]
    prompt = torch.from_numpy(tokens[:, :GEN_PROMPT]).long()
    runs = {}
    with torch.no_grad():
        for name, use_cache in (("cached", True), ("uncached", False)):
            out = model.generate(prompt, max_new_tokens=GEN_NEW, do_sample=False, use_cache=use_cache,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None, attention_mask=torch.ones_like(prompt))
            runs[name] = (out.sequences[:, GEN_PROMPT:].numpy().astype(int).tolist(), torch.stack(out.scores, 1))
    top2 = runs["uncached"][1].topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    agree = runs["cached"][0] == runs["uncached"][0]
    record = dict(
        transformers_version=transformers.__version__, torch_version=torch.__version__,
        description=f"greedy generate: the first {GEN_PROMPT} tokens of each row of golden.npz's tokens as the "
        f"prompt (index_topk {model.config.index_topk}: top-k selection active), {GEN_NEW} new tokens, no EOS",
        prompt=tokens[:, :GEN_PROMPT].astype(int).tolist(), max_new_tokens=GEN_NEW,
        hf_generate_cached=runs["cached"][0], hf_generate_uncached=runs["uncached"][0],
        cached_equals_uncached=agree, reference="hf_generate_cached" if agree else "hf_generate_uncached",
        min_top2_logit_margin=margin,
    )
    assert margin > 1e-4, f"{out_dir}: greedy path has a near-tie (margin {margin:.2e}); pick another prompt"
    with open(os.path.join(out_dir, "generate.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"  generate: cached == uncached: {agree}; min top-2 margin {margin:.2e}")
    return record


def _cfg_equal(a, b):
    drop = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
    a = {k: v for k, v in a.items() if k not in drop}
    b = {k: v for k, v in b.items() if k not in drop}
    if a != b:
        print({k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
    return a == b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures", help="output root (default tests/fixtures)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="cases (default all)")
    ap.add_argument("--seed", type=int, default=0, help="first seed to try (default 0)")
    ap.add_argument("--gap", type=float, default=1e-3, help="min relative top-k score gap (default 1e-3)")
    ap.add_argument("--generate_only", action="store_true",
                    help=f"only (re)write generate.json (HF greedy generate) of the existing {GEN_CASES} fixtures")
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    if args.generate_only:
        for name in GEN_CASES:
            if name in args.cases:
                print(f"== {name} (generate)")
                record_generate(os.path.join(args.out, f"hf_{name}"))
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.cases:
        print(f"== {name}")
        out_dir, meta = generate(name, CASES[name], args.out, args.seed, args.gap)
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
        rows.append((name, meta, size))

    print()
    hdr = f"{'case':9} {'seed':>5} {'B':>2} {'S':>3} {'topk':>4} {'max|logit|':>10} {'sparse-dense':>12} " \
          f"{'idx gap':>8} {'rtr gap':>8} {'np rel err':>10} {'size KB':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, m, size in rows:
        c = m["checks"]
        print(f"{name:9} {m['seed']:>5} {m['batch']:>2} {m['seq_len']:>3} {m['index_topk']:>4} "
              f"{m['max_abs_logit']:>10.4f} {c['sparse_vs_dense_rel']:>12.3e} {c['min_index_gap_rel']:>8.1e} "
              f"{c['min_router_gap_rel']:>8.1e} {c['numpy_ref_rel_err']:>10.2e} {size / 1024:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
