"""The paper's dense warm-up (section 2.1.1) for DeepSeek-V3.2 from DeepSeek-V3.1-Terminus: dense attention,
every parameter frozen except the lightning indexer, KL to the head-summed attention (eq. 3); lr 1e-3,
1000 steps x 16 sequences x 128K tokens (2.1B tokens). Mesh: 2048 devices (256 nodes x 8): the 16 sequences split
over fsdp:16, each 128K sequence over seq:16 (8K tokens per device; MLA all-gathers the keys), heads / hidden
units over tensor:8 (parameters 128-way: fsdp x tensor). Fits an 80 GB device: the full 61-layer step compiled for
a deviceless H100 topology needs 1.14 GiB of arguments + 11.88 GiB temp = 13.0 GiB per device, with the routed
experts split over seq as well and the MoE blocks scanned (BENCHMARKS.md, "The 671B recipes")."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "warmup"
    c.model = "deepseek_v32_671b"
    c.init_from = ""  # the converted V3.1-Terminus checkpoint (python -m dsv32_jax.checkpoint.convert hf-to-orbax ...)
    c.dtype = "bfloat16"
    c.param_dtype = "bfloat16"
    c.mesh = "fsdp:16,tensor:8,seq:16"  # batch 16 = fsdp:16 (data:4,fsdp:32,expert:16 would split it 2048 ways)
    c.steps = 1000
    c.optimizer.lr = 1e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 10
    c.data.seq_len = 131072
    c.data.shuffle_window = 16  # rows of 128K: 2M tokens per window (512 held 67M, packed again at each refill)
    c.data.batch_size = 16
    c.attn_chunk = 128  # [128, 128 heads, 128K] fp32 logits per query chunk (bench/memory.py)
    c.index_chunk = 128
    c.remat = "full"  # a block keeps only its input for the backward (bench/memory.py)
    c.scan_layers = True  # the 58 MoE blocks as one lax.scan: one compiled block body
    c.checkpoint.every = 100
    return c
