"""Deviceless sm_90a compile of a probe kernel (the recipe of tools/gpu_compile/gpu_compile.py: h100() +
compile_one), then the facts from MOSAIC_GPU_DUMP_TO: ptxas registers/spills, smem, wgmma shapes in the PTX, HGMMA in
the SASS. Run through cc.sh (sets JAX_PLATFORMS=cpu, PATH to ptxas, XLA_FLAGS, MOSAIC_GPU_DUMP_TO)."""
import glob, os, re, sys, time, traceback
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "tools", "gpu_compile"))
TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "tools", "gpu_compile", "h100_target_config.txtpb")


def h100():
    from jax.experimental import topologies
    with open(TARGET) as f:
        return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=f.read()).devices[0]


def compile_and_report(fn, arg_shapes, tag):
    import jax
    dump = os.environ.get("MOSAIC_GPU_DUMP_TO", "")
    dev = h100()
    specs = [jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.SingleDeviceSharding(dev)) for s, d in arg_shapes]
    t0 = time.perf_counter()
    try:
        with jax.default_device(dev):
            lowered = jax.jit(fn).trace(*specs).lower()
        lowered.compile()
    except Exception as e:
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_error.txt"), "w").write(str(e))
        print(f"[{tag}] COMPILE FAILED after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {str(e)[:3000]}")
        tb = traceback.extract_tb(e.__traceback__)
        for fr in tb[-8:]:
            print(f"    {fr.filename}:{fr.lineno} {fr.name}")
        return False
    print(f"[{tag}] compiled in {time.perf_counter() - t0:.1f}s; dumps in {dump}")
    report(dump, tag)
    return True


def report(dump, tag):
    for res in sorted(glob.glob(os.path.join(dump, "*.resources.txt"))):
        base = res[: -len(".resources.txt")]
        txt = open(res).read()
        print(f"[{tag}] {os.path.basename(base)} resources: {' '.join(txt.split())[:400]}")
        if os.path.exists(base + ".ptxas"):
            p = open(base + ".ptxas").read()
            for line in p.splitlines():
                if re.search(r"registers|spill|stack frame|smem|Warning", line):
                    print(f"[{tag}]   ptxas: {line.strip()}")
        if os.path.exists(base + ".ptx"):
            ptx = open(base + ".ptx").read()
            ins = {}
            for m in re.findall(r"\b(wgmma\.mma_async[\w.:]*|wgmma\.(?:fence|commit_group|wait_group)[\w.:]*|"
                                r"cp\.async\.[\w.:]+|mbarrier\.[\w.:]+|bar\.sync|bar\.arrive|barrier\.[\w.:]+|"
                                r"cp\.async\.bulk\.tensor[\w.:]*|st\.shared[\w.:]*|ld\.shared[\w.:]*|ex2\.approx[\w.:]*|"
                                r"setmaxnreg[\w.:]*|stmatrix[\w.:]*|ldmatrix[\w.:]*)", ptx):
                ins[m] = ins.get(m, 0) + 1
            for k in sorted(ins):
                print(f"[{tag}]   ptx: {k} x{ins[k]}")
        for sass in glob.glob(base + ".sass*"):
            s = open(sass).read()
            cnt = {}
            for m in re.findall(r"\b([QH]GMMA\.[\w.]+|LDGSTS\.[\w.]+|STL\.?[\w.]*|LDL\.?[\w.]*|MUFU\.EX2|SHFL\.\w+|"
                                r"UTMALDG[\w.]*|BAR\.\w+|SYNCS\.[\w.]+|USETMAXREG[\w.]*)", s):
                cnt[m] = cnt.get(m, 0) + 1
            print(f"[{tag}]   sass: {', '.join(f'{k} x{v}' for k, v in sorted(cnt.items()))}")
