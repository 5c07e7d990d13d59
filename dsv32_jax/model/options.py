"""Run-time options of the model's forward pass (which attention path, which indexer path). Static: changing
them changes the traced program. Set them on a model with `model.options = RunOptions(...)`."""

from __future__ import annotations

import dataclasses

import numpy as np

ATTENTION_IMPLS = ("sparse", "dense", "kernel")
# Rematerialization of each decoder block (jax.checkpoint policies): what the backward pass may keep from the
# forward. "none": everything (fastest, most memory); "full": only the block's inputs (recompute the block);
# "dots": matmul outputs; "dots_no_batch": matmul outputs without batch dimensions (weights-like products).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
MLA_MODES = ("mqa", "mha")
KL_KEY_GRADS = ("dense", "segment_sum", "scatter")  # eq. 4's key gradient (indexer_loss.selected_scores)
MLA_BWDS = ("recompute", "stored", "atomic")  # the sparse MLA kernel's GPU backward (dsv32_jax.kernels.sparse_mla, bwd=)
MLA_FWDS = ("triton", "mosaic_gpu", "mosaic_gpu_pingpong")  # the sparse MLA kernel's GPU forward (dsv32_jax.kernels.sparse_mla, fwd=)
MLA_PDS = ("triton", "mosaic_gpu")  # its stored backward's P / dS kernel (dsv32_jax.kernels.sparse_mla, pds=)
MLA_DQKV = ("triton", "mosaic_gpu")  # its stored backward's dq / dkv kernel (dsv32_jax.kernels.sparse_mla, dqkv=)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    # "sparse": gathered top-k rows in plain JAX (eq. 2, O(T*k)); "dense": masked dense reference;
    # "kernel": the Pallas kernels from `dsv32_jax.kernels` (pallas_kernels/) for the indexer selection
    # (`indexer_topk`: FP8 quant, logits, top-k) and the sparse MLA; on a mesh they run per device inside one
    # shard_map over every mesh axis (`dsv32_jax.model.mla.kernel_parallel`), resolved for the mesh's chip.
    attention: str = "sparse"
    # Execution mode of the dense reference: absorbed MQA ("mqa") or decompressed per-head MHA ("mha").
    mla_mode: str = "mqa"
    # False: plain dense causal attention and no indexer selection (the dense warm-up stage, a dense model).
    dsa: bool = True
    # Production indexer path: Hadamard rotation + e4m3 with ue8m0 scales (else exact float32 scores).
    indexer_fp8: bool = False
    # Simulate the FP8 latent cache (c_kv quantize/dequantize in 128-blocks, as the official demo since 2025-11-17).
    fp8_kv: bool = False
    # Indexer training objective computed per layer (returned in aux["indexer_kl"]): None, "dense" (eq. 3, KL to
    # the head-summed dense attention, plus the captured-mass metric) or "sparse" (eq. 4, on the selected set).
    indexer_loss: str | None = None
    # Query-chunk sizes that bound the references' memory (each chunk is rematerialized in the backward pass).
    attn_chunk: int = 64
    index_chunk: int = 128
    # Per-block rematerialization policy (REMAT_POLICIES).
    remat: str = "none"
    # Training / scoring forward: runs of consecutive decoder blocks of one structure (the MoE blocks of DeepSeek-V3)
    # as one `lax.scan` over their stacked parameters instead of a Python loop: the compiled program holds one block
    # body instead of 58, so XLA compiles the 671B step in bounded host memory and time. Same numbers either way.
    scan_layers: bool = False
    # How eq. 4's gradient reaches the indexer keys (`indexer_loss.KEY_GRADS`, `indexer_loss.selected_scores`), all
    # the same gradient up to float32 summation order. "dense": matmuls per key block, no scatter (the default: on
    # an H200 the 12-layer small step at 8K took 1.60 s with it, 4.09 s with "scatter"); "segment_sum": per-slot
    # float32 rows summed into the keys by one flat segment sum (O(T k) work instead of O(T^2); on an H200 the
    # 4-layer step with it, the FP8 selection and the stored backward ran 2.37x the dense stage's at 64K; its own
    # share is not yet separated); "scatter": autodiff of the gather (a scatter-add of the [chunk, k, D] model-dtype key rows, 636 of
    # 925 ms of a 2-layer kernel step at 8K on an H200). BENCHMARKS.md, issue 31.
    kl_key_grad: str = "dense"
    # The GPU backward of the sparse MLA kernel (attention="kernel"; `kernels.sparse_mla(bwd=...)`; the TPU kernels
    # have one fused backward and ignore it): "stored" (the default: P and dS computed once on 64-head wgmma tiles
    # and stored per token chunk, then dq and the dkv rows by column slices; H200, k 2048, 128 heads: 84-88
    # TFLOP/s, 1.14-1.21x XLA's autodiff) or "recompute" (dq and dkv kernels that each recompute S and dP; 62-64
    # TFLOP/s in the same run), or "atomic" (stored, with the dkv rows added in place by fp32 atomics: no
    # [T, k, 576] partials or segment sum; not bitwise reproducible; not yet timed on a chip). Same gradients up to
    # float32 summation order. BENCHMARKS.md, issue 31.
    mla_bwd: str = "stored"
    # The GPU forward of the sparse MLA kernel (attention="kernel"; `kernels.sparse_mla(fwd=...)`): "triton" (the
    # default, measured: 158-165 TFLOP/s on an H200) or "mosaic_gpu" (issue 31 item 2's FlashMLA-shaped Hopper kernel,
    # `sparse_mla_mgpu`: compiled for sm_90a and tested in interpret mode, not yet run on a chip; Dqk 576 / d_v 512
    # only) or "mosaic_gpu_pingpong" (its ping-pong form at 64 heads per CTA: a key block per warpgroup, S on wgmma
    # N = 64; the same status). TPU and reference runs ignore it.
    mla_fwd: str = "triton"
    # The stored / atomic backward's P and dS kernel (`kernels.sparse_mla(pds=...)`): "triton" (the default) or
    # "mosaic_gpu" (`sparse_mla_pds_mgpu`, issue 31 item 3: two warpgroups, cp.async gather, wgmma N = 32; compiled
    # for sm_90a and tested in interpret mode, not yet run on a chip; Dqk 576 / d_v 512 only).
    mla_pds: str = "triton"
    # The stored backward's dq and dkv kernel (`kernels.sparse_mla(dqkv=...)`): "triton" (the default) or "mosaic_gpu"
    # (`sparse_mla_dqkv_mgpu`, issue 31 item 3: two ping-pong warpgroups, cp.async gather, wgmma N = 64; compiled for
    # sm_90a and tested in interpret mode, not yet run on a chip; Dqk 576 / d_v 512, at most 128 heads per device,
    # mla_bwd="stored" only).
    mla_dqkv: str = "triton"

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"RunOptions.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.mla_mode not in MLA_MODES:
            raise ValueError(f"RunOptions.mla_mode must be one of {MLA_MODES}, got {self.mla_mode!r}")
        if self.mla_mode == "mha" and self.attention != "dense":
            raise ValueError("RunOptions.mla_mode='mha' runs only with attention='dense' (sparse paths are MQA mode)")
        if self.mla_bwd not in MLA_BWDS:
            raise ValueError(f"RunOptions.mla_bwd must be one of {MLA_BWDS}, got {self.mla_bwd!r}")
        if self.mla_fwd not in MLA_FWDS:
            raise ValueError(f"RunOptions.mla_fwd must be one of {MLA_FWDS}, got {self.mla_fwd!r}")
        if self.mla_pds not in MLA_PDS:
            raise ValueError(f"RunOptions.mla_pds must be one of {MLA_PDS}, got {self.mla_pds!r}")
        if self.mla_dqkv not in MLA_DQKV:
            raise ValueError(f"RunOptions.mla_dqkv must be one of {MLA_DQKV}, got {self.mla_dqkv!r}")
        if self.mla_dqkv == "mosaic_gpu" and self.mla_bwd != "stored":
            raise ValueError(f"RunOptions.mla_dqkv='mosaic_gpu' needs mla_bwd='stored' (got {self.mla_bwd!r}): the "
                             "Mosaic GPU dq / dkv kernel writes the stored backward's partials")
        if self.kl_key_grad not in KL_KEY_GRADS:
            raise ValueError(f"RunOptions.kl_key_grad must be one of {KL_KEY_GRADS}, got {self.kl_key_grad!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"RunOptions.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"RunOptions.indexer_loss must be None, 'dense' or 'sparse', got {self.indexer_loss!r}")
        if self.indexer_loss == "sparse" and not self.dsa:
            raise ValueError("RunOptions.indexer_loss='sparse' needs dsa=True (it trains on the selected set)")
        for name in ("dsa", "indexer_fp8", "fp8_kv", "scan_layers"):  # ("false" is truthy: it switched a path on)
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise ValueError(f"RunOptions.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("attn_chunk", "index_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"RunOptions.{name} must be an integer >= 1, got {v!r}")
        if self.attention == "kernel":
            import_kernels()

    def replace(self, **changes) -> "RunOptions":
        return dataclasses.replace(self, **changes)


def import_kernels():
    """Import `dsv32_jax.kernels` (and with it Pallas' Triton / Mosaic modules) now, outside any trace. Importing
    them registers JAX config options that are part of jit's cache key (the trace context); imported lazily inside
    the first trace of a jitted step, they changed that key after the first call, so the second call traced and
    compiled the whole step again (the small config's kernel train step on an H200: 10-20 s more for its second
    step; `tests/test_train.py::test_kernel_step_compiles_once`). A checkout without the installed layout has no
    `dsv32_jax.kernels`: the kernel path then fails where it runs, with that import's error."""
    try:
        import dsv32_jax.kernels  # noqa: F401
    except ImportError:
        pass
