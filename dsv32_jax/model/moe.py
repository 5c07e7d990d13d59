"""DeepSeek-V3 FFNs: dense SwiGLU MLP, and the MoE with sigmoid router, auxiliary-loss-free correction bias
(selection only), group-limited top-k, shared expert, and dropless routed experts via `jax.lax.ragged_dot` (on
GPUs: the same function over blocks of rows, `blocked_experts`).

The router returns the chosen expert ids, and accepts recorded ids to replay them ("keep routing", GRPO):
the gate weights are then recomputed from the live scores for the given ids, so the router still learns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv32_jax.model import sharding
from dsv32_jax.model.config import ModelConfig
from dsv32_jax.model.layers import Dense, normal_param, take_rows


class ExpertBias(nnx.Variable):
    """e_score_correction_bias: updated by the load-balancing rule, never by gradients (not an nnx.Param)."""


def route(logits: jnp.ndarray, bias: jnp.ndarray, cfg: ModelConfig, replay_ids: jnp.ndarray | None = None):
    """Router of DeepSeek-V3 ("noaux_tc"). logits [N, E] -> (weights [N, k] f32, ids [N, k] int32).

    sigmoid scores; score + bias picks the groups (sum of each group's top-2) and then the top-k experts;
    weights are the unbiased scores of the chosen experts, normalized, times routed_scaling_factor.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    if replay_ids is None:
        choice = scores + bias.astype(jnp.float32)
        n, e = choice.shape
        if cfg.n_group > 1:
            grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    else:
        ids = replay_ids
    ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * cfg.routed_scaling_factor, ids


def _token_axes(mesh, n_tokens: int) -> tuple[str, ...]:
    """The mesh axes that split the flattened tokens [B x T]: the longest leading run of the batch axes, then seq,
    whose product divides them (as the activations are split); () when the first does not divide."""
    return sharding.dividing_run(sharding.BATCH_AXES + (sharding.SEQ_AXIS,), n_tokens, mesh.shape)


def _route_tokens(logits, bias, cfg: ModelConfig, replay_ids=None):
    """`route` on each device's own tokens (shard_map over the token axes) when the mesh splits the tokens: left to
    GSPMD, the top-k selections were computed on every token of the batch on every device."""
    mesh = sharding.current_mesh()
    axes = () if mesh is None else _token_axes(mesh, logits.shape[0])
    if not axes:
        return route(logits, bias, cfg, replay_ids)
    tok = P(axes, None)
    replay = () if replay_ids is None else (replay_ids,)

    def local(logits, bias, *replay):
        return route(logits, bias, cfg, *replay)

    return jax.shard_map(local, mesh=mesh, in_specs=(tok, P()) + (tok,) * len(replay), out_specs=(tok, tok),
                         axis_names=set(axes), check_vma=False)(logits, bias, *replay)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the product is formed in float32."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)
        self.gate_proj = Dense(d_model, d_ff, ("embed", "mlp"), **kw)
        self.up_proj = Dense(d_model, d_ff, ("embed", "mlp"), **kw)
        self.down_proj = Dense(d_ff, d_model, ("mlp", "embed"), **kw)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)) * self.up_proj(x).astype(jnp.float32)
        return self.down_proj(h.astype(x.dtype))


class Experts(nnx.Module):
    """Routed experts, weights stacked per layer: w_gate/w_up [E, D, I], w_down [E, I, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.w_gate = normal_param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), param_dtype, std)
        self.w_up = normal_param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), param_dtype, std)
        self.w_down = normal_param(rngs, (e, i, d), ("expert", "moe_mlp", "embed"), param_dtype, std)
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
        """Dropless: x [N, D], ids/weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), float32 [N, D].

        Under a mesh that splits the tokens (batch or seq axes) or the experts, the dispatch runs per device on its
        own tokens (`_expert_parallel`): a global sort + scatter over every token of the batch is what GSPMD would
        otherwise replicate (the 671B recipes: a [tokens x top-8 x hidden] scatter on every device)."""
        w = (self.w_gate[...].astype(self.dtype), self.w_up[...].astype(self.dtype), self.w_down[...].astype(self.dtype))
        mesh = sharding.current_mesh()
        if mesh is not None and any(mesh.shape[a] > 1 for a in sharding.BATCH_AXES + (sharding.SEQ_AXIS,)):
            return _expert_parallel(mesh, x.astype(self.dtype), ids, weights, w)
        return _grouped_swiglu(x.astype(self.dtype), ids, weights, w, first_expert=0)


def _grouped_swiglu(x, ids, weights, w, first_expert):
    """Experts [first_expert, first_expert + E_local) of w = (gate, up, down) applied to the tokens routed to them
    (others contribute zero): `ragged_experts` (the reference) or, lowered for GPUs, `blocked_experts` (the same
    function in bounded memory). Returns float32 [N, D]."""
    return jax.lax.platform_dependent(x, ids, weights, *w, jnp.asarray(first_expert, jnp.int32),
                                      cuda=blocked_experts, default=ragged_experts)


def _sort_by_expert(ids, num_local: int, first_expert):
    """Assignments (token, slot) flattened to N x k, sorted by local expert (others -> a trailing dummy group):
    (order [N k], group_sizes [E_local])."""
    local = ids.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(local, stable=True)
    return order, jnp.bincount(local, length=num_local + 1)[:num_local].astype(jnp.int32)


def ragged_experts(x, ids, weights, w_gate, w_up, w_down, first_expert):
    """Reference: tokens sorted by expert, one ragged_dot per projection, the outputs weighted and summed back to
    their tokens. XLA:GPU expands each ragged_dot into a dense [E, N k, D] masked operand (the 671B warm-up: 224 GiB
    per device), hence `blocked_experts` there."""
    n, k = ids.shape
    order, group_sizes = _sort_by_expert(ids, w_gate.shape[0], first_expert)
    xs = take_rows(x, order // k, n)  # (each token's k rows' gradients summed in float32)

    def gmm(lhs, rhs):  # rows past sum(group_sizes) (the dummy group) come out as zeros
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

    ys = gmm((jax.nn.silu(gmm(xs, w_gate)) * gmm(xs, w_up)).astype(x.dtype), w_down)
    gate = weights.astype(jnp.float32).reshape(-1)[order]
    return jnp.zeros((n, ys.shape[1]), jnp.float32).at[order // k].add(ys * gate[:, None])


def blocked_experts(x, ids, weights, w_gate, w_up, w_down, first_expert, *, block: int = 128,
                    blocks_per_step: int = 8):
    """`ragged_experts` in O(N x D) memory: each expert's sorted rows cut into blocks of `block` rows (its last
    block padded), at most ceil(N k / block) + E blocks; a lax.scan takes `blocks_per_step` blocks at a time,
    gathers their tokens and experts' weights, and adds the weighted SwiGLU outputs into the [N, D] result. The
    backward (`_block_scan`'s) recomputes each step's blocks, keeping only the (token, gate, expert) indices per
    step, and sums the gradients in float32."""
    n, k = ids.shape
    g, d = w_gate.shape[0], x.shape[1]
    order, group_sizes = _sort_by_expert(ids, g, first_expert)
    steps = -(-(-(-n * k // block) + g) // blocks_per_step)
    nb = steps * blocks_per_step
    blocks = -(-group_sizes // block)
    block_end = jnp.cumsum(blocks)
    j = jnp.arange(nb)
    e = jnp.minimum(jnp.searchsorted(block_end, j, side="right"), g - 1)  # each block's expert
    starts = jnp.cumsum(group_sizes) - group_sizes
    row = (starts[e] + (j - (block_end - blocks)[e]) * block)[:, None] + jnp.arange(block)  # sorted rows [nb, B]
    valid = row < (starts + group_sizes)[e][:, None]
    slot = order[jnp.where(valid, row, 0)]
    token = (slot // k).reshape(steps, -1)
    gate = jnp.where(valid, weights.astype(jnp.float32).reshape(-1)[slot], 0.0).reshape(steps, -1)

    return _block_scan(x, w_gate, w_up, w_down, gate, token, e.reshape(steps, -1), blocks_per_step)


def _swiglu_rows(xb, wg, wu, wd, gate, dtypes):
    """The weighted SwiGLU outputs [P x B, D] float32 of P blocks of B rows xb [P, B, D] through their experts'
    weights [P, D, I] / [P, I, D], each operand first cast to its dtype in `dtypes` (x's and the weights': the
    backward passes float32 copies) and the hidden units to x's."""
    xb, wg, wu, wd = (a.astype(t) for a, t in zip((xb, wg, wu, wd), dtypes))
    h = jax.nn.silu(jnp.einsum("pbd,pdi->pbi", xb, wg, preferred_element_type=jnp.float32))
    h = h * jnp.einsum("pbd,pdi->pbi", xb, wu, preferred_element_type=jnp.float32)
    out = jnp.einsum("pbi,pid->pbd", h.astype(dtypes[0]), wd, preferred_element_type=jnp.float32)
    return out.reshape(-1, out.shape[-1]) * gate[:, None]


def _dtypes(*arrays) -> tuple:
    return tuple(a.dtype for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _block_scan(x, w_gate, w_up, w_down, gate, token, e, blocks_per_step):
    """sum over steps of the blocks' weighted outputs, scattered to their tokens: [N, D] float32. token, gate
    [steps, P x B], e [steps, P]. The backward recomputes each step's blocks and sums the gradients in float32:
    x's in a carry, each expert's weights' over its blocks, rounded to their dtype once per expert
    (`_block_scan_bwd`). Autodiff summed them in bf16: the transposes of the per-block gathers scatter-add bf16
    rows into bf16 carries (3x the bf16 rounding floor at 32K rows on one expert; audit, 2026-12-07)."""
    n, d = x.shape

    def step(y, inputs):
        tok, gt, ee = inputs
        xb = x[tok].reshape(blocks_per_step, -1, d)
        rows = _swiglu_rows(xb, w_gate[ee], w_up[ee], w_down[ee], gt, _dtypes(x, w_gate, w_up, w_down))
        return y.at[tok].add(rows), None

    return jax.lax.scan(step, jnp.zeros((n, d), jnp.float32), (token, gate, e))[0]


def _block_scan_fwd(x, w_gate, w_up, w_down, gate, token, e, blocks_per_step):
    return _block_scan(x, w_gate, w_up, w_down, gate, token, e, blocks_per_step), (x, w_gate, w_up, w_down, gate,
                                                                                   token, e)


def _block_scan_bwd(blocks_per_step, res, gy):
    """Each step's blocks recomputed and differentiated in float32 (float32 copies of the gathered rows and weights:
    their cotangents come back float32). x's gradient sums in a float32 carry ([N, D]). The weights' would need a
    float32 [E, D, I] carry per projection (the 671B step: +9 GiB per device, measured), so, the blocks being
    sorted by expert, each expert's gradient sums in a float32 [D, I] accumulator over its consecutive blocks and is
    added into the weights' dtype carry when the next expert's blocks begin: rounded once per expert (plus
    zeros)."""
    x, w_gate, w_up, w_down, gate, token, e = res
    n, d = x.shape
    dtypes = _dtypes(x, w_gate, w_up, w_down)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

    def step(carry, inputs):
        dx, dws, cur, accs = carry
        tok, gt, ee = inputs
        xb = f32(x[tok]).reshape(blocks_per_step, -1, d)
        _, vjp = jax.vjp(lambda *a: _swiglu_rows(*a, dtypes), xb, f32(w_gate[ee]), f32(w_up[ee]), f32(w_down[ee]), gt)
        gx, *gws, ggt = vjp(gy[tok])
        dx = dx.at[tok].add(gx.reshape(-1, d))
        for p in range(blocks_per_step):  # (blocks in expert order)
            flush = (ee[p] != cur).astype(jnp.float32)  # the accumulated expert's blocks ended: add it (else + 0)
            dws = tuple(dw.at[cur].add((acc * flush).astype(dw.dtype)) for dw, acc in zip(dws, accs))
            accs = tuple(acc * (1.0 - flush) + g[p] for acc, g in zip(accs, gws))
            cur = ee[p]
        return (dx, dws, cur, accs), ggt

    ws = (w_gate, w_up, w_down)
    init = (jnp.zeros((n, d), jnp.float32), tuple(jnp.zeros(w.shape, w.dtype) for w in ws), e[0, 0],
            tuple(jnp.zeros(w.shape[1:], jnp.float32) for w in ws))
    (dx, dws, cur, accs), dgate = jax.lax.scan(step, init, (token, gate, e))
    dws = tuple(dw.at[cur].add(acc.astype(dw.dtype)) for dw, acc in zip(dws, accs))
    return (dx.astype(x.dtype), *dws, dgate.astype(gate.dtype), None, None)


_block_scan.defvjp(_block_scan_fwd, _block_scan_bwd)


def _expert_parallel(mesh, x, ids, weights, w):
    """Token-sharded dispatch with shard_map, expert-parallel when the `expert` axis is > 1: the tokens [N, D] stay
    split as the activations are (batch axes, then seq: N = B x T flattened), experts split over `expert` (their
    hidden units over `tensor`, their model dim over `fsdp`, gathered per layer as FSDP does). Each device
    all-gathers the tokens of its expert group (none to gather without expert parallelism), runs only its local
    experts on them (dropless), and a reduce-scatter returns every token's summed expert outputs to its owner. The
    tokens split over the longest leading run of (batch axes, seq) that divides them (`_token_axes`); when that run
    stops before "expert", the group's devices hold the same tokens and sum their experts' outputs (all-reduce)."""
    n_ep = mesh.shape["expert"]
    batch = _token_axes(mesh, x.shape[0])
    # a weight dimension that its axis does not divide stays whole on every device, as the rule table stores it
    # (`sharding.array_spec`): split anyway, shard_map refused the mesh (hidden 64 on fsdp:6)
    fsdp = "fsdp" if mesh.shape["fsdp"] > 1 and w[0].shape[1] % mesh.shape["fsdp"] == 0 else None
    tensor = "tensor" if mesh.shape["tensor"] > 1 and w[0].shape[2] % mesh.shape["tensor"] == 0 else None
    # the expert dimension as the parameters are stored: over "expert" (expert parallelism) and, when the rule
    # table says so and the count divides, over "seq" too (ZeRO-3: gathered below, its gradient reduce-scattered)
    stored = sharding.array_spec(("expert",), w[0].shape[:1], mesh.shape, sharding.current_rules())[0]
    stored = () if stored is None else (stored,) if isinstance(stored, str) else tuple(stored)
    zero = tuple(a for a in stored if a != "expert")
    e_axes = (("expert",) if n_ep > 1 else ()) + zero
    e_spec = e_axes[0] if len(e_axes) == 1 else (e_axes or None)
    tok = P(batch or None, None)
    w_specs = (P(e_spec, fsdp, tensor), P(e_spec, fsdp, tensor), P(e_spec, tensor, fsdp))
    if not batch or w[0].shape[0] % n_ep:  # no token split, or experts that "expert" does not divide: GSPMD's
        return _grouped_swiglu(x, ids, weights, w, first_expert=0)
    # tokens split over "expert" too: each device gathers its expert group's tokens and gets its own back summed
    # (reduce-scatter); tokens that "expert" does not split (a leading run of the batch axes stops before it) are
    # the same on the group's devices: each runs its experts on them and the outputs are summed (all-reduce)
    gather = n_ep > 1 and "expert" in batch

    def body(x, ids, weights, w_gate, w_up, w_down):
        # the weights' all-gather waits for this layer's tokens: depending on parameters only, XLA's scheduler
        # started every layer's gather at the top of the step (the 61-layer warm-up: 52 x 0.9 GiB live at once)
        x, w_gate, w_up, w_down = jax.lax.optimization_barrier((x, w_gate, w_up, w_down))
        for axis in zero:  # ZeRO over seq: this expert group's experts, in order
            w_gate, w_up, w_down = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (w_gate, w_up, w_down))
        if fsdp:  # FSDP: gather the model dim of the local experts' weights
            w_gate = jax.lax.all_gather(w_gate, fsdp, axis=1, tiled=True)
            w_up = jax.lax.all_gather(w_up, fsdp, axis=1, tiled=True)
            w_down = jax.lax.all_gather(w_down, fsdp, axis=2, tiled=True)
        if gather:
            x, ids, weights = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, ids, weights))
        first = jax.lax.axis_index("expert") * w_gate.shape[0]
        y = _grouped_swiglu(x, ids, weights, (w_gate, w_up, w_down), first)
        if tensor:
            y = jax.lax.psum(y, tensor)
        if gather:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert") if n_ep > 1 else y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok) + w_specs, out_specs=tok, check_vma=False)
    return fn(x, ids, weights, *w)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.router = normal_param(rngs, (cfg.hidden_size, cfg.n_routed_experts), ("embed", None), jnp.float32,
                                   cfg.initializer_range)
        self.bias = ExpertBias(jnp.zeros((cfg.n_routed_experts,), jnp.float32), axes=(None,))
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared = MLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size, rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype, std=cfg.initializer_range) if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, x: jnp.ndarray, replay_ids: jnp.ndarray | None = None):
        """x [B, T, D] -> (y [B, T, D], aux); replay_ids [B, T, k] replays a recorded routing.

        aux: "routing" expert ids [B, T, k]; "router_prob" [B, T, E] the normalized affinities s / sum(s) that the
        sequence-wise balance loss averages (DeepSeek-V3 eq. 17-20)."""
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        logits = jnp.dot(xf.astype(jnp.float32), self.router[...].astype(jnp.float32))
        replay = None if replay_ids is None else replay_ids.reshape(b * t, -1)
        weights, ids = _route_tokens(logits, self.bias[...], self.cfg, replay)
        y = self.experts(xf, ids, weights)
        if self.shared is not None:
            y = y + self.shared(xf).astype(jnp.float32)
        scores = jax.nn.sigmoid(logits)
        aux = {"routing": ids.reshape(b, t, -1),
               "router_prob": (scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(b, t, -1)}
        return y.astype(x.dtype).reshape(b, t, d), aux
