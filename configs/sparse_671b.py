"""The paper's sparse training stage: top-k 2048 sparse attention, all parameters trained, the indexer by the
KL on its selected set with detached inputs (eq. 4); lr 7.3e-6, 15000 steps x 480 sequences x 128K tokens
(943.7B tokens). Mesh: 2048 devices (256 nodes x 8): the 480 sequences split over fsdp:32 (15 per shard), each
sequence over seq:16, heads / hidden units over tensor:4; 15 microbatches (one sequence per fsdp shard per forward
+ backward); the routed experts' weights and AdamW moments split over fsdp x tensor x seq (2048-way), the rest
128-way. Fits an 80 GB device: the full 61-layer step (MoE blocks scanned) compiled for a deviceless H100 topology
needs 5.57 GiB of arguments + 28.56 GiB temp = 34.1 GiB per device with the plain-JAX attention (BENCHMARKS.md,
"The 671B recipes") and 5.57 + 28.93 = 34.5 GiB with the Pallas kernels it runs (attention="kernel", compiled for
the H100s: "Kernels in the sharded steps")."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "sparse"
    c.model = "deepseek_v32_671b"
    c.init_from = "runs/warmup_671b"
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.attention = "kernel"
    c.mesh = "fsdp:32,tensor:4,seq:16"  # batch 480 over fsdp:32 (a 2048-way batch split cannot divide 480)
    c.steps = 15000
    c.optimizer.lr = 7.3e-6
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 100
    c.loss.mtp_weight = 0.1
    c.loss.bias_update_speed = 1e-3
    c.loss.balance_weight = 1e-4
    c.data.seq_len = 131072
    c.data.shuffle_window = 16  # rows of 128K: 2M tokens per window (512 held 67M, packed again at each refill)
    c.data.batch_size = 480
    c.microbatches = 15  # 15 sequences per fsdp shard: one 128K sequence per shard per forward + backward
    c.attn_chunk = 128  # [128, 128 heads, 128K] fp32 logits per query chunk (bench/memory.py)
    c.index_chunk = 128
    c.remat = "full"  # a block keeps only its input for the backward (bench/memory.py)
    c.scan_layers = True  # the 58 MoE blocks as one lax.scan: one compiled block body
    c.checkpoint.every = 250
    return c
