"""Sparse MLA forward for ONE token, 64 heads, K selected keys (blocks of 64), on Pallas Mosaic GPU (jax 0.12).

    out [64, 512] = softmax(scale * q kv[idx]^T) kv[idx][:, :512],  lse [64] (natural log; -inf for an empty row)

Structures (`mode`):
  wg1     one warpgroup: gather -> S = q kv^T (wgmma N=64) -> online softmax in registers -> O += P V as two
          wgmmas N=256 into two [64, 256] f32 register accumulators (carried through the key loop).
  dup3    num_threads=3: WG2 = producer (gathers into the kv buffer(s), arrives kv_full), WG0 / WG1 = consumers,
          each recomputes the full S (duplicate QK) and owns 256 output columns; both arrive kv_free.
  share3  num_threads=3: WG0 computes S + softmax, writes P (bf16, swizzled smem) and the rescale alpha (smem),
          arrives p_full; WG0 and WG1 each do PV for their 256 columns; WG1 waits p_full; both arrive p_free/kv_free.
`pv`: "smem" (P through a [64, 64] bf16 tiled+swizzled smem buffer) or "reg" (P as the register A operand of wgmma).
`gather`: a function (kv_gmem, idx_ref [64], kv_smem [64, 576]) -> None that fills the buffer and makes it visible
to the async proxy for this warpgroup: the Pallas-level row loop (interpret) or gather_mgpu's inline_mgpu cp.async.
"""
import functools, importlib.util, math, os
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

H, DQK, DV, BK = 64, 576, 512, 64
HALF = DV // 2
LOG2E = math.log2(math.e)


def gather_pallas(kv_gmem, idx_ref, kv_smem):
    """Interpret mode: row r <- kv[idx[r]] (zeros for idx < 0) by a Pallas-level register copy."""
    def row(r, c):
        i = idx_ref[r]
        v = kv_gmem[pl.ds(jnp.maximum(i, 0), 1), :]
        kv_smem[pl.ds(r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
        return c
    jax.lax.fori_loop(0, kv_smem.shape[0], row, 0)
    plgpu.commit_smem()


def gather_cp_async(sync_warpgroup=True):
    """On the chip: pallas_kernels/gather_mgpu.py's inline_mgpu cp.async gather (loaded by path)."""
    spec = importlib.util.spec_from_file_location("gather_mgpu", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "pallas_kernels", "gather_mgpu.py"))
    gm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gm)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.inline_mgpu(arg_types=gm.gather_arg_types(plgpu, tiles))(
        functools.partial(gm._gather_rows, rows=BK, d=DQK, sync_warpgroup=sync_warpgroup))


def _iparams():
    """Interpret params; PROBE_RACES=1 turns on the happens-before race detector (raises on a race)."""
    import os
    return plgpu.InterpretGPUParams(detect_races=os.environ.get("PROBE_RACES") == "1")


def _row(x):
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _softmax_block(s, valid, m, l, scale):
    """Online softmax step on S [64, 64] f32 (WGMMA layout); m in log2 units. Returns p16, alpha, m_new, l_new."""
    s2 = jnp.where(valid[None, :], s * (scale * LOG2E), -jnp.inf)
    m_new = jnp.maximum(m, s2.max(axis=1))
    base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(base, s2.shape, [0]))
    alpha = jnp.exp2(m - base)
    l_new = l * alpha + p.sum(axis=1)
    return p.astype(jnp.bfloat16), alpha, m_new, l_new


def _finish(o_halves, m, l):
    safe = jnp.where(l > 0, l, 1.0)
    outs = [(o / jax.lax.broadcast_in_dim(safe, o.shape, [0])).astype(jnp.bfloat16) for o in o_halves]
    base = jnp.where(m == -jnp.inf, 0.0, m)
    lse = jnp.where(l > 0, (base + jnp.log2(safe)) / LOG2E, -jnp.inf)
    return outs, lse


def _qk(q_smem, kv):
    def mm(acc):
        plgpu.wgmma(acc, q_smem, kv.T)
        return acc[...]
    return pl.run_scoped(mm, plgpu.ACC((H, BK), jnp.float32))


def _pv(o_halves, a, kv, halves, pv_acc="run_state"):
    """o_h <- o_h + a @ kv[:, 256 h : 256 h + 256] for h in halves (o_h already rescaled).
    pv_acc: "run_state"  pl.run_state(...)(ACC.init(o)) (the FA3 example's form: accumulate in place, both wgmmas in
                         flight together),
            "add"        a fresh zeroed ACC per block (run_scoped) and o + pv in registers (twice the accumulator
                         registers on the chip)."""
    if pv_acc == "run_state":
        def body(accs):
            for acc, h in zip(accs, halves):
                plgpu.wgmma(acc, a, kv.at[:, pl.ds(h * HALF, HALF)])
        return pl.run_state(body)(tuple(plgpu.ACC.init(o) for o in o_halves))
    def body(*accs):
        for acc, h in zip(accs, halves):
            plgpu.wgmma(acc, a, kv.at[:, pl.ds(h * HALF, HALF)])
        return tuple(acc[...] for acc in accs)
    pvs = pl.run_scoped(body, *[plgpu.ACC((H, HALF), jnp.float32) for _ in halves])
    return tuple(o + p for o, p in zip(o_halves, pvs))


def sparse_mla_token(q, kv, idx, *, scale, mode="wg1", pv="smem", gather=gather_pallas, interpret=False,
                     nbuf=1, o_via_q=False, maxreg=True, pv_acc="run_state"):
    """q [64, 576] bf16, kv [N, 576] bf16, idx [K] int32 (K % 64 == 0) -> out [64, 512] bf16, lse [64] f32."""
    k = idx.shape[0]
    nblk = k // BK
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    SM = plgpu.SMEM

    def qo_scratch():
        """q [64, 576] and the output tile [64, 512]: aliased (plgpu.RefUnion: q is dead once the last QK is done)
        when o_via_q, else two buffers."""
        q_t = SM((H, DQK), jnp.bfloat16, transforms=tiles)
        o_t = SM((2, H, HALF), jnp.bfloat16, transforms=tiles)  # per-half contiguous: TMA stores need that
        return plgpu.RefUnion(q_t, o_t) if o_via_q else [q_t, o_t]

    out_type = (jax.ShapeDtypeStruct((H, DV), jnp.bfloat16), jax.ShapeDtypeStruct((H,), jnp.float32))

    if mode == "wg1":
        def body(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, kv_smem, p_smem, idx_smem, lse_smem, bars):
            q_smem, o_smem = qo
            plgpu.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
            plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
            plgpu.barrier_wait(bars.at[1])
            plgpu.barrier_wait(bars.at[0])
            zero = plgpu.layout_cast(jnp.zeros((H, HALF), jnp.float32), plgpu.Layout.WGMMA)
            carry0 = (zero, zero, _row(jnp.full((H,), -jnp.inf, jnp.float32)), _row(jnp.zeros((H,), jnp.float32)))

            def step(b, carry):
                o0, o1, m, l = carry
                idx_blk = idx_smem.at[b]
                gather(kv_gmem, idx_blk, kv_smem)
                s = _qk(q_smem, kv_smem)
                valid = plgpu.load(idx_blk, layout=plgpu.Layout.WGMMA.reduce(0)) >= 0
                p16, alpha, m, l = _softmax_block(s, valid, m, l, scale)
                o0 = o0 * jax.lax.broadcast_in_dim(alpha, o0.shape, [0])
                o1 = o1 * jax.lax.broadcast_in_dim(alpha, o1.shape, [0])
                if pv == "smem":
                    p_smem[...] = p16
                    plgpu.commit_smem()
                    a = p_smem
                else:
                    a = p16
                o0, o1 = _pv((o0, o1), a, kv_smem, (0, 1), pv_acc)
                return o0, o1, m, l

            o0, o1, m, l = jax.lax.fori_loop(0, nblk, step, carry0)
            (r0, r1), lse = _finish((o0, o1), m, l)
            o_smem.at[0][...] = r0
            o_smem.at[1][...] = r1
            lse_smem[...] = lse
            plgpu.commit_smem()
            for h in range(2):
                plgpu.copy_smem_to_gmem(o_smem.at[h], out_gmem.at[:, pl.ds(h * HALF, HALF)])
            plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
            plgpu.wait_smem_to_gmem(0)

        scratch = [qo_scratch(), SM((BK, DQK), jnp.bfloat16, transforms=tiles),
                   SM((H, BK), jnp.bfloat16, transforms=tiles),
                   SM((nblk, BK), jnp.int32), SM((H,), jnp.float32), plgpu.Barrier(num_barriers=2)]
        return plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                            interpret=_iparams() if interpret else None,
                            compiler_params=plgpu.CompilerParams(approx_math=True))(q, kv, idx.reshape(nblk, BK))

    # ---- warp-specialized: WG0, WG1 consumers (256 output columns each), WG2 producer (the gather) ----
    def body(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, kv_smem, p_smem, a_smem, idx_smem, lse_smem,
             bars, kv_full, kv_free, p_full, p_free, done):
        q_smem, o_smem = qo
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == (2 if mode != "share2" else 99))
        def _producer():
            if maxreg:
                plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
            plgpu.barrier_wait(bars.at[1])

            def step(b, c):
                slot = jax.lax.rem(b, nbuf)

                @pl.when(b >= nbuf)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])
                gather(kv_gmem, idx_smem.at[b], kv_smem.at[slot])
                plgpu.barrier_arrive(kv_full.at[slot])
                return c
            jax.lax.fori_loop(0, nblk, step, 0)

        def epilogue(w, o, m, l):
            """Both consumers past their last QK (done barrier: q_smem, aliased by o_smem, is free), then this WG's
            256 output columns (and WG0's lse) through smem and TMA."""
            (r,), lse = _finish((o,), m, l)
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            o_smem.at[w][...] = r
            if w == 0:
                lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[w], out_gmem.at[:, pl.ds(w * HALF, HALF)])
            if w == 0:
                plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
            plgpu.wait_smem_to_gmem(0)

        def init():
            zero = plgpu.layout_cast(jnp.zeros((H, HALF), jnp.float32), plgpu.Layout.WGMMA)
            return zero, _row(jnp.full((H,), -jnp.inf, jnp.float32)), _row(jnp.zeros((H,), jnp.float32))

        def wait_kv(b):
            slot = jax.lax.rem(b, nbuf)  # a literal 0 (nbuf=1) captured by run_scoped / pl.when fails the lowering (TypedInt)
            if os.environ.get("PROBE_BREAK") != "1":   # negative control: skip the consumer's kv_full wait
                plgpu.barrier_wait(kv_full.at[slot])
            return slot

        if mode == "dup3":
            # one code path for both consumers (the branch index wg is traced; no cond inside the key loop)
            @pl.when(wg < 2)
            def _consumer():
                if maxreg:
                    plgpu.set_max_registers(232, action="increase")

                @pl.when(wg == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
                plgpu.barrier_wait(bars.at[0])
                if mode == "share2":
                    plgpu.barrier_wait(bars.at[1])

                def step(b, carry):
                    o, m, l = carry
                    slot = wait_kv(b)
                    kv = kv_smem.at[slot]
                    s = _qk(q_smem, kv)
                    valid = plgpu.load(idx_smem.at[b], layout=plgpu.Layout.WGMMA.reduce(0)) >= 0
                    p16, alpha, m, l = _softmax_block(s, valid, m, l, scale)
                    o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [0])
                    if pv == "smem":
                        p_smem.at[wg][...] = p16
                        plgpu.commit_smem()
                        a = p_smem.at[wg]
                    else:
                        a = p16
                    (o,) = _pv((o,), a, kv, (wg,), pv_acc)
                    plgpu.barrier_arrive(kv_free.at[slot])
                    return o, m, l

                o, m, l = jax.lax.fori_loop(0, nblk, step, init())
                (r,), lse = _finish((o,), m, l)
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
                o_smem.at[wg][...] = r

                @pl.when(wg == 0)
                def _():
                    lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[:, pl.ds(wg * HALF, HALF)])

                @pl.when(wg == 0)
                def _():
                    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
                plgpu.wait_smem_to_gmem(0)
        else:  # share3 / share2: WG0 = QK + softmax + PV (columns 0:256), WG1 = PV (columns 256:512) from WG0's P in smem
            @pl.when(wg == 0)
            def _wg0():
                if maxreg and mode == "share3":
                    plgpu.set_max_registers(232, action="increase")
                plgpu.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
                plgpu.barrier_wait(bars.at[0])
                if mode == "share2":
                    plgpu.barrier_wait(bars.at[1])

                def step(b, carry):
                    o, m, l = carry
                    slot = wait_kv(b)
                    kv = kv_smem.at[slot]
                    s = _qk(q_smem, kv)
                    valid = plgpu.load(idx_smem.at[b], layout=plgpu.Layout.WGMMA.reduce(0)) >= 0
                    p16, alpha, m, l = _softmax_block(s, valid, m, l, scale)
                    plgpu.barrier_wait(p_free)   # WG1 done with P / alpha of block b-1 (pre-arrived once)
                    p_smem[...] = p16
                    a_smem.at[0][...] = alpha
                    a_smem.at[1][...] = m
                    a_smem.at[2][...] = l
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_full)
                    o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [0])
                    (o,) = _pv((o,), p_smem if pv == "smem" else p16, kv, (0,), pv_acc)
                    plgpu.barrier_arrive(kv_free.at[slot])
                    return o, m, l

                o, m, l = jax.lax.fori_loop(0, nblk, step, init())
                epilogue(0, o, m, l)

            @pl.when(wg == 1)
            def _wg1():
                if maxreg and mode == "share3":
                    plgpu.set_max_registers(232, action="increase")
                if mode == "share2":
                    plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
                    plgpu.barrier_wait(bars.at[1])
                plgpu.barrier_arrive(p_free)

                def step(b, o):
                    if mode == "share2":   # WG1 is also the producer: gather block b itself (no third warpgroup)
                        slot_p = jax.lax.rem(b, nbuf)

                        @pl.when(b >= nbuf)
                        def _():
                            plgpu.barrier_wait(kv_free.at[slot_p])
                        gather(kv_gmem, idx_smem.at[b], kv_smem.at[slot_p])
                        plgpu.barrier_arrive(kv_full.at[slot_p])
                    slot = wait_kv(b)
                    plgpu.barrier_wait(p_full)
                    alpha = plgpu.load(a_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
                    o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [0])
                    (o,) = _pv((o,), p_smem, kv_smem.at[slot], (1,), pv_acc)
                    plgpu.barrier_arrive(p_free)
                    plgpu.barrier_arrive(kv_free.at[slot])
                    return o

                o = jax.lax.fori_loop(0, nblk, step, init()[0])
                m = plgpu.load(a_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
                l = plgpu.load(a_smem.at[2], layout=plgpu.Layout.WGMMA.reduce(1))
                epilogue(1, o, m, l)

    scratch = [qo_scratch(), SM((nbuf, BK, DQK), jnp.bfloat16, transforms=tiles),
               SM((2, H, BK) if mode == "dup3" else (H, BK), jnp.bfloat16, transforms=tiles), SM((3, H), jnp.float32),
               SM((nblk, BK), jnp.int32), SM((H,), jnp.float32),
               plgpu.Barrier(num_barriers=2),
               plgpu.Barrier(num_barriers=nbuf), plgpu.Barrier(num_barriers=nbuf, num_arrivals=2),
               plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(num_arrivals=2)]
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, num_threads=2 if mode == "share2" else 3,
                        thread_name="wg",
                        interpret=_iparams() if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True))(q, kv, idx.reshape(nblk, BK))
